"""Token recycling (`proposer`, `matrix`, `options`, `assets`)."""
