"""CSV downloads that a spreadsheet opens safely."""


def text_cell(value: str) -> str:
    """A spreadsheet runs a cell that starts like a formula; text that others chose (a memo, a
    model name a client sent, a GPU name an agent reported) must stay text."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


class Echo:
    """A file for csv.writer that hands each written line back: csv.writer(Echo()).writerow(row)
    returns the row's text, so a download can be streamed line by line."""

    def write(self, value: str) -> str:
        return value
