"""Ahead-of-time compiling (`python -m flexdraft_jax aot`): the programs a decode
run and a drafter's training step compile, built from shapes and compiled for
a TPU slice that is not attached (`programs`), the chips' published numbers
(`chips`), and the report of memory, cost and a roofline step time (`report`)."""
