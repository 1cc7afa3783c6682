"""The one exception the data layer raises for problems a user can fix."""


class DataError(ValueError):
    """A corpus, tokenizer or sampling problem, described in one actionable line."""
