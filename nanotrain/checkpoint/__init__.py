"""nanotrain.checkpoint"""
