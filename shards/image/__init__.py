"""Images in shards: what may be decoded and how, torch-free, under build and loader alike.

`policy` is the one decode policy (formats sniffed by magic bytes, the pixel cap, truncation,
alpha, EXIF orientation, the optional fast backends and the `auto` rule); `geometry` the
resize rules both sides share (filters, reducing gap, the DCT-draft rule); `bands` the JPEG
restart-interval codec that lets a crop decode only the intervals under it, and the proof
that such a band shows exactly what a whole decode shows. `preprocess.images` writes with
them and `pipeline.decode` reads with them; neither holds rules of its own.
"""
