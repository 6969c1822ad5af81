"""What a local network's faucet gives a gateway above the network's stake.

A real network's KVR is bought or earned, and its stake is held in the operator's wallet;
on a local chain the faucet stands in for both (`kvasird wallet faucet --stake`, and
`kvasird localnet` for its own nodes), so a network built by hand runs gateways too.
"""

from __future__ import annotations

from kvasird.settlement.token import KVR_DECIMALS

OWN_USE = 1000 * 10**KVR_DECIMALS
"""KVR a local gateway's operator gets above its stake for its own requests, which it pays
the peers for like anyone's: millions of short requests at genesis prices."""
