"""The scheduler: requests, sequence groups, the block manager and the FCFS/preemption policy."""
