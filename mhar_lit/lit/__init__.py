"""Lightning layer: module, callbacks, routing backend selection."""
