"""What the interpreter raises and warns."""


class NkiError(Exception):
    """A kernel broke an NKI rule or a hardware limit; the message names the call and the rule."""


class NkiRangeWarning(RuntimeWarning):
    """An activation function was given inputs outside its documented range: the result there is invalid (NaN)."""
