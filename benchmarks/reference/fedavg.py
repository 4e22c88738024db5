"""The FedAvg rounds every reference loop shares, in plain PyTorch.

Each round every site starts from the global model with a fresh Adam (or, with
``carry_optimizer``, the Adam it trained with last round, its moments kept), makes
``epochs`` passes over its cases in shuffled batches of ``batch_size``
(``loss(net, x, y, site_index)`` gives the batch loss, augmentation included;
with ``mu`` > 0 FedProx's (mu/2)||w - w_global||^2 over the parameters is
added to it), and the server averages every tensor of the site models by the
sites' case counts. The test metric is computed at each round in ``eval_rounds``.
``start(net, k, rnd)`` (optional) is called once a site has received the global
model, before it trains (rounds count from 1): a rule that needs the received
model or the round keeps them there.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def run(make_net, sites, loss, evaluate, rounds: int, eval_rounds, gen: torch.Generator, lr: float,
        batch_size: int, epochs: int = 1, weight_decay: float = 0.0, log=print, tag: str = "",
        carry_optimizer: bool = False, mu: float = 0.0, start=None) -> dict:
    """``sites``: [(images, targets)]; returns the metric per eval round and the seconds of every round."""
    global_net = make_net()
    share = torch.tensor([len(y) for _, y in sites], dtype=torch.float64)
    share = share / share.sum()
    # a carried Adam keeps its site's network (its moments are keyed by that network's parameters, which
    # load_state_dict overwrites in place each round)
    kept = [None] * len(sites)
    out, seconds = {}, []
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        states = []
        for k, (x, y) in enumerate(sites):
            if kept[k] is None or not carry_optimizer:
                net = make_net()
                kept[k] = (net, torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay))
            net, opt = kept[k]
            net.load_state_dict(global_net.state_dict())
            if start is not None:
                start(net, k, rnd)
            anchor = [p.detach().clone() for p in net.parameters()] if mu > 0 else None
            net.train()
            for _ in range(epochs):
                order = torch.randperm(len(y), generator=gen)
                for i in range(0, len(y), batch_size):
                    idx = order[i:i + batch_size]
                    batch_loss = loss(net, x[idx], y[idx], k)
                    if anchor is not None:
                        batch_loss = batch_loss + 0.5 * mu * sum(((p - a) ** 2).sum()
                                                                 for p, a in zip(net.parameters(), anchor))
                    opt.zero_grad()
                    batch_loss.backward()
                    opt.step()
            states.append(net.state_dict())
        # every tensor averaged (integer counters too, cast back to their type)
        global_net.load_state_dict({key: sum(float(w) * s[key].double() for w, s in zip(share, states)).to(states[0][key].dtype)
                                    for key in states[0]})
        seconds.append(time.perf_counter() - t0)
        if rnd in eval_rounds:
            out[rnd] = evaluate(global_net)
            log(f"[reference] {tag}round {rnd}: {out[rnd]}")
    return {"metrics": out, "seconds_per_round": float(np.mean(seconds)), "seconds": seconds}
