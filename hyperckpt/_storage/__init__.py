"""Below every stage, the seam to storage: the only code that opens, creates, stats or removes a file.

The stages above ask it for names, sizes, stamps and byte ranges, never for a path to
``os.open``.  ``protocol`` says what they may ask (``Storage``, ``StorageFile``,
``NewFile``), ``files`` answers it for a local directory, ``remote`` for a prefix in object
storage (``s3://``, ranged GETs), ``places`` tells which a path names, ``opener`` is the
guarded way a local file is opened and read, ``stamp`` the identity that tells a changed
file.  No torch.
"""
