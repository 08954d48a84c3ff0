"""The measuring instrument: speed and accuracy benchmarks behind `mxattn bench` and `mxattn accuracy`."""
