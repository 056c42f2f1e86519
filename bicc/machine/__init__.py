"""The machine: processes and devices (distributed), what a step's ranks share (ranks) and a sharded checkpoint's
parts (dcp), host threads and allocator (host), the memory model (memory), where rollout workers go and what their
host needs (layout), a scheduler's stop signals and what a preempted save has (preemption), progress bars and metric
logs (progress, tracking), and ``make setup-gpu``'s install (setup_gpu). Imports only ``bicc.registry``; every other
folder may import it."""
