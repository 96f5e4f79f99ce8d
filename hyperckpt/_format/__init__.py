"""Stage 1, one file: the bytes of a safetensors file in, a frozen, validated ``FileHeader`` out.

Takes a path or header bytes and the file size; gives dtype, shape and absolute byte range per tensor.  No torch.
"""
