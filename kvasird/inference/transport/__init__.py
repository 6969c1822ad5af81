"""Transport: how inference messages travel between peers.

channel    request/response with ids (and one-way frames) over one long-lived stream
           per peer and protocol, every wait bounded; serve() is the handler side
lane       a direct TCP connection keyed over libp2p that carries a channel's hot path
"""
