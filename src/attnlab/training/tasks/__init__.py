"""Tasks as generators: dates, copy, reverse, sort, addition, and character-level text."""
