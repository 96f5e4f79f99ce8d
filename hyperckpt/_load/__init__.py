"""The public entry points: reading options, the two DCP readers, ``load`` and ``describe``."""
