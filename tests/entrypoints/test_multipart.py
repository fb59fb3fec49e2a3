"""multipart/form-data parsing (entrypoints/http/multipart.py): binary file bytes come back
byte for byte (CR/LF inside them included), field names and filenames are read, and malformed
bodies are 400s that say what is wrong."""
import pytest

from epdserve.entrypoints.http import multipart
from epdserve.entrypoints.http.errors import ApiError

BOUNDARY = "----b0undary"


def _body(*parts) -> bytes:
    out = b""
    for name, data, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disp}\r\n".encode()
        out += (b"Content-Type: image/png\r\n" if filename else b"") + b"\r\n" + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def test_fields_and_binary_bytes_round_trip():
    data = bytes(range(256)) * 3 + b"\r\n\r\n--" + b"\r\n"
    form = multipart.parse(_body(("purpose", b"vision", None), ("file", data, "cat.png")),
                           f"multipart/form-data; boundary={BOUNDARY}")
    assert form["purpose"].data == b"vision" and form["purpose"].filename is None
    assert form["file"].data == data and form["file"].filename == "cat.png"
    assert form["file"].content_type == "image/png"


@pytest.mark.parametrize("body, ctype, why", [
    (b"{}", "application/json", "must be multipart/form-data"),
    (b"", "multipart/form-data", "without a boundary"),
    (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\r\n".encode(),
     f"multipart/form-data; boundary={BOUNDARY}", "no closing boundary"),
    (f"--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nx\r\n--{BOUNDARY}--".encode(),
     f"multipart/form-data; boundary={BOUNDARY}", "no field name"),
])
def test_malformed_bodies_are_400(body, ctype, why):
    with pytest.raises(ApiError) as e:
        multipart.parse(body, ctype)
    assert e.value.status == 400 and why in e.value.message
