"""nanotrain.precision"""
