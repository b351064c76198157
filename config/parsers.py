"""The REST API's JSON parser: DRF's, with a body nested too deeply for the decoder answered as
a 400 like any other malformed body (Python's json recurses and gives up with RecursionError
at the interpreter's depth, which DRF would let through as a 500)."""

from rest_framework import exceptions, parsers


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - the body is nested too deeply.") \
                from None
