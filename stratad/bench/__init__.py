"""`stratad bench`: measured performance as JSON, each result with its hardware, floor and fraction reached."""
