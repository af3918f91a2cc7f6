"""`pagedserve serve --ray-address`: replicas and their tensor-parallel ranks placed by Ray.

Imported only on that path: nothing else in pagedserve imports Ray.
"""
