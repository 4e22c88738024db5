"""The composed method: the papers' rules, each where a site's profile calls for it (docs/methods/composed.md).

A federation of one multi-label task whose sites label differently at once: some annotate every
class, some a subset, some none. No paper's method covers all three; this one takes each part from
the paper that treats that kind of site, and each part is on only where the sites' label summaries
(read at the server before round 0) make it apply:

* **Missing entries learn from a mean teacher** (RSCFed's and IsoFed's teacher, as ``rscfed_pl``
  runs it on partial labels): every site trains the partial BCE on the entries it annotates, and
  ``consistency_weight`` x the mean squared difference between the student's sigmoid on the strong
  view and the teacher's on the weak view over the entries it does not annotate (the teacher starts
  each round as the received model and follows the student by EMA, ``ema_alpha``). At a site that
  annotates nothing every entry is missing, so it trains on its images without labels; at a site
  that annotates everything the term is empty. ``consistency_weight=0`` turns the part off: a site
  that annotates nothing then has nothing to learn and abstains.
* **Isolated step for the unlabeled group** (IsoFed): when some sites annotate no class, each round
  first trains those sites from the global model and averages them into W_u, then trains the
  sites that annotate something from W_u, whose aggregate is the new global model. Server option
  ``isolate`` (default on); off, or with no unlabeled site, every site trains in one step.
* **Class-wise head over the annotating sites** (Surgical Aggregation, Eq. 2): in a step with
  annotating sites the features (every key but the head's) are averaged by n_k over the step's
  sites, and head row c is the unweighted mean of the rows of the sites that annotate c; a class
  no site of the step annotates keeps the step's starting row. A site that annotates nothing never
  counts for a row. Server option ``classwise_head`` (default on); off, every key is averaged by n_k.
  A step of unlabeled sites only (the isolated step) averages every key by n_k: no site of it has a
  row to count, and their consistency training moves the head too.

What a site sends: the model, its head's name and its label summary, as Surgical Aggregation's.
"""

from __future__ import annotations

from .aggregate import average_keys
from .base import START_GLOBAL, START_PREVIOUS, ServerRule, Step
from .pseudo_labels import PartialMeanTeacherClient
from .surgical import HeadMetaMixin, SurgicalServer


class ComposedClient(HeadMetaMixin, PartialMeanTeacherClient):
    """Partial BCE on the annotated entries + mean-teacher consistency on the missing ones (every entry
    at a site that annotates nothing); such a site abstains when the consistency term is off."""

    def abstains(self, round, extras):
        no_labels = not self.ctx.summary.get("labeled")
        return super().abstains(round, extras) or (no_labels and self.consistency_weight == 0)


class ComposedServer(SurgicalServer):
    """IsoFed's isolated step for the sites that annotate nothing, Surgical's class-wise head in the
    step of the sites that annotate something, features by n_k."""

    def __init__(self, isolate=True, classwise_head=True, head_name=None):
        super().__init__(weighted=True, head_name=head_name)
        self.isolate, self.classwise_head = bool(isolate), bool(classwise_head)
        self.unlabeled = set()

    def setup(self, summaries):
        super().setup(summaries)
        self.unlabeled = {s for s, v in summaries.items() if not v.get("labeled")}
        labeled = sorted(set(summaries) - self.unlabeled)
        partial = sorted(s for s in labeled if not all(summaries[s]["labeled_mask"]))
        if not labeled:
            raise ValueError(f"no site annotates any class ({sorted(summaries)}): the composed method needs a "
                             "site with labels")
        isolated = self.isolate and self.unlabeled
        return [f"composed: sites annotating every class {sorted(set(labeled) - set(partial))}, some classes "
                f"{partial}, none {sorted(self.unlabeled)}",
                ("isolated step: " + (f"{sorted(self.unlabeled)} train first from the global model, then "
                                      f"{labeled} from their average" if isolated else
                                      "off (" + ("option isolate false" if self.unlabeled else "no unlabeled site")
                                      + "): every site trains in one step")),
                ("head: class-wise over the annotating sites" if self.classwise_head else
                 "head: averaged with the features (option classwise_head false)")]

    def plan(self, round, sites):
        unlabeled = tuple(s for s in sites if s in self.unlabeled)
        labeled = tuple(s for s in sites if s not in self.unlabeled)
        if not (self.isolate and unlabeled and labeled):
            return [Step(tuple(sites))]
        return [Step(unlabeled, START_GLOBAL, name="unlabeled"), Step(labeled, START_PREVIOUS, name="labeled")]

    def aggregate(self, updates, global_weights, round):
        if not updates:
            return dict(global_weights)
        if not self.classwise_head or all(u.site in self.unlabeled for u in updates):
            return average_keys(updates, global_weights, [u.n for u in updates])
        return super().aggregate(updates, global_weights, round)

    def screen(self, update, global_weights, round, step):
        return super().screen(update, global_weights, round, step) if self.classwise_head else \
            ServerRule.screen(self, update, global_weights, round, step)


def _register():
    from . import FROM_MODEL, WITHOUT_LABELS, Method, register

    register(Method("composed", ComposedClient, ComposedServer, ("multilabel",), uses_unlabeled=True,
                    strong_view=True, partial_site=FROM_MODEL, unlabeled_site=WITHOUT_LABELS, doc="composed: mean teacher on missing entries, IsoFed's isolated step for "
                                          "unlabeled sites, Surgical's class-wise head"))


_register()
