"""`RankFailure`: a tensor-parallel rank died or a collective failed — the instance cannot go on
(engine/tp/group.py says what then happens)."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the instance cannot go on."""
