"""nanotrain.data"""
