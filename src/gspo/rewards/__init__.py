"""(layer docstring: filled in below)"""
