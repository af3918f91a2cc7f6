"""The pagedserve processes: gateway, scheduler and executor."""
