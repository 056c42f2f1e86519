"""The machine: processes and devices (distributed), host threads and allocator (host), the memory model
(memory), progress bars and metric logs (progress, tracking). Imports only ``bicc.registry``; every other
folder may import it."""
