"""nanotrain.models"""
