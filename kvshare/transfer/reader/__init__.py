"""The reader's side of every transport: fetching blocks into a worker's memory over ``shm``,
``nixl`` (pull and push), ``objstore``, and peer fetch across holders.
"""
