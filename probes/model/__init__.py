"""The model as modscope sees it: the structure walk, the immutable model index, modules found at run
time, and the frozen blocks around normalization and dropout layers."""
