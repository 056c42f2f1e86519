"""The machine: processes and devices (distributed), host threads and allocator (host), the memory model
(memory), where rollout workers go and what their host needs (layout), a scheduler's stop signals (preemption),
progress bars and metric logs (progress, tracking). Imports only ``bicc.registry``; every other
folder may import it."""
