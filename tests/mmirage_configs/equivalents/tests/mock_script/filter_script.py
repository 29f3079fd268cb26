def text_length(row: dict) -> int:
    """The length of the row's text (the filter keeps the longer ones)."""
    return len(row.get("text", ""))
