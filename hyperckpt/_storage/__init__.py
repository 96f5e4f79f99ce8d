"""Stage 1, the seam to storage: the only code that opens, creates, stats or removes a file.

The stages above ask it for names, sizes, stamps and byte ranges, never for a path to
``os.open``.  ``files`` holds the :class:`~hyperckpt._storage.files.Storage` protocol and
its local implementation, ``opener`` the guarded way a local file is opened and read,
``stamp`` the identity that tells a changed file.  No torch.
"""
