"""chunk_deepstack: the visual rows of a prompt chunk and their DeepStack feature rows."""
import pytest
import torch

from epdserve.model.deepstack import chunk_deepstack

V = 9  # the visual token id


def _feats(n, base):
    """An item of n visual tokens: [embeds, layer 0, layer 1]; row r of layer l holds base + 10*l + r."""
    rows = torch.arange(n, dtype=torch.float32)[:, None]
    return [rows + base, rows + base + 10, rows + base + 20]


def test_chunk_cuts_two_images():
    ids = [1, V, V, V, 2, V, V, 3]
    media = [_feats(3, 100), _feats(2, 200)]
    rows, layers = chunk_deepstack(ids, (V,), media, 2, 6)  # tokens 2..5: image 0 rows 1-2, image 1 row 0
    assert rows == [0, 1, 3]
    assert layers[0][:, 0].tolist() == [111, 112, 210]
    assert layers[1][:, 0].tolist() == [121, 122, 220]


def test_text_only_chunk_and_decode_tokens():
    ids = [1, V, V, 2, 3]
    assert chunk_deepstack(ids, (V,), [_feats(2, 0)], 3, 5) is None
    assert chunk_deepstack(ids, (V,), [_feats(2, 0)], 5, 6) is None  # past the prompt


def test_too_few_feature_rows_is_an_error():
    with pytest.raises(ValueError, match="cover"):
        chunk_deepstack([V, V, V], (V,), [_feats(2, 0)], 0, 3)
