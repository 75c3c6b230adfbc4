"""The I/O edge: paths on any fsspec filesystem (:mod:`.fs`), reading files (:mod:`.files`),
writing them atomically and durably (:mod:`.atomic`). Nothing here knows checkpoints or merges."""
