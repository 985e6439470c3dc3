# Types of the compiled receive-and-verify loop (csrc/recv_verify.c).
def recv_xxh3_into(
    fd: int, buffer: bytearray | memoryview, piece_bytes: int, deadline: float, /
) -> tuple[int, int, bytes | None]: ...
def xxh3_128_digest(data: bytes | bytearray | memoryview, /) -> bytes: ...
def copy_xxh3(
    target: bytearray | memoryview,
    source: bytes | bytearray | memoryview,
    piece_bytes: int,
    populate: bool = False,
    /,
) -> bytes: ...
