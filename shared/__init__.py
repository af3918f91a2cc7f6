"""Wire protocol, configuration and errors shared by every pagedserve process."""
