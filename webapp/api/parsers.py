"""The API's JSON request parser: DRF's, with :func:`jobs.validation.loads` in place of ``json.load``,
so a body nested thousands of levels deep is a 400 before Python's recursion limit is reached (where
``json.load`` would raise a RecursionError, a 500).

``NaN`` and ``Infinity`` parse (to float NaN and infinity) instead of failing the whole body as DRF's
strict mode does: each field then refuses them with its own message and the path inside the value
(``params: dropout: the number is NaN``), as it refuses ``1e400``, which no parser can tell apart
from a valid number."""

from __future__ import annotations

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser, get_encoding

from jobs import validation


class BoundedJSONParser(JSONParser):
    """``application/json`` bodies of at most ``validation.MAX_JSON_DEPTH`` + 1 levels (the body's own
    object around its fields, then each field's value up to the limit).

    Raises ParseError (400, ``{"detail": "JSON parse error - <what and where>"}``) for text that is not
    JSON in the request's charset, nests deeper, holds an integer of more than 4,300 digits or a string
    with an unpaired surrogate (named by its path, e.g. ``config.region``). What a
    parsed value may still hold (NaN, infinity, NUL characters) is each field's error: the typed
    fields' (a number field refuses NaN) and ``jobs.services``' for JSON values.
    """

    max_depth = validation.MAX_JSON_DEPTH + 1

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = get_encoding(parser_context or {})  # refuses bytes-to-bytes codecs (bz2_codec)
        try:
            text = stream.read().decode(encoding)
        except UnicodeDecodeError as exc:
            raise ParseError(f"JSON parse error - the body is not {encoding} text ({exc}).") from None
        try:
            data = validation.loads(text, max_depth=self.max_depth)
        except validation.JSONInputError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        where = validation.unpaired_surrogate(data)
        if where is not None:
            # Refused here, not by the field: its error message would echo the value, and a response
            # cannot be encoded with it in (a UnicodeEncodeError in the renderer, a 500).
            raise ParseError(f"JSON parse error - {where or 'the body'}: a string holds an unpaired surrogate "
                             f"(\\ud800-\\udfff escapes not in a pair), which is not text; remove it.")
        return data
