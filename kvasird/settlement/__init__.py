"""Settlement on Solana: local chain, pay-per-inference, receipts, claims, floating price.

The rule: credit only what the chain proves, never what a client asserts; every
balance has exactly one writer.

    config.py       SettlementConfig: [settlement] of kvasird.toml and what tests tune (never the
                    price band)
    errors.py       SettlementError and its tree
    token.py        KVR amounts (base units) and SPL transfer/mint/memo instructions
    wallet.py       operator keypair file / address-only wallet; wallet↔peer-id link statements
    chain.py        ChainClient: solana-py AsyncClient under trio; typed ChainTransaction
    localchain/     LiteSVM behind a JSON-RPC facade on 127.0.0.1 (KVR mint, faucet, persistence)
    ledger.py       SQLite (WAL) tables of every money fact
    locks.py        per-key locks around each money operation
    verify.py       what a transaction proves: vault delta, mint, memo binding, sender binding
    payments.py     quotes → payment verification (one-shot signatures), prepaid deposits
    x402.py         x402's "exact" scheme on Solana: the transaction a payer signs, checked
                    before the gateway co-signs it as fee payer; a client for the x402 package
    redemptions.py  which paid quotes have served a request at this gateway (each serves one)
    pricing.py      NetworkParams and the utilization-driven PriceController
    governance.py   network parameters change only by genesis-signed, versioned messages
    gossip.py       the governance topic: validate (verify before relaying), apply, re-publish
    rewards.py      gateway-measured work → tiers → revenue split → earnings and receipts
    receipts.py     signed cumulative receipts; the peer's ReceiptBook (which gateway owes what)
    admission.py    no work without pay: a peer serves a gateway only while it is staked and pays
    exchange.py     "/kvasir/settle/1" between peers: receipts delivered, claims paid and verified
    claims.py       payouts (claims, refunds): pending record → send → confirm → debit; reconcile
    admin.py        operator sign-in: SIWS wallet signature + TOTP with replay protection
    service.py      run_settlement(): assembles all of it for the daemon

Data flow (gateway):

    consumer ──quote──▶ Payments.quote ──(request id private, memo public)──▶ consumer pays vault
    consumer ──signature──▶ Payments.settle_quote ──ChainClient.transaction──▶ verify ──▶ ledger
    inference done ──MeasuredWork (every hop the route used, as the gateway counted it)
        ──▶ Rewards.settle ──▶ earnings, receipts ──Exchange.deliver──▶ each peer's ReceiptBook
    inference failed ──▶ Rewards.settle(served part) ──▶ Payouts.refund (insurance → payer on chain)
    peer ──claim (Exchange)──▶ Payouts.claim ──lock──▶ pending payout ──send/confirm──▶ debit
        ──▶ the peer checks the payout on chain (ReceiptBook.verify_payout)

Data flow (serving peer): a session opens (stage) or rows arrive (expert worker) only if
Admission admits the gateway: its record links a wallet holding the stake minimum (read on
chain), its unpaid receipts stay under max_unpaid, and it keeps sending receipts.
"""
