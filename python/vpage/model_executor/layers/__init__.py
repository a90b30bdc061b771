"""Building blocks of the decoder models: norms, rotary, linear layers, paged attention."""
