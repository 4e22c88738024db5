"""Scoring weights on a scenario's test split: the one scorer of ``fedlabels bench``, ``fedlabels report``,
the in-process references and the benchmarks (the clinical bundle's test report, with its thresholds and
intervals, is ``fedlabels.bundle.card``'s)."""

from __future__ import annotations

POOLED, MEAN = "pooled", "mean"
# Test metrics per task: (metric, has a per-class value).
TEST_METRICS = {
    "multilabel": (("auroc", True), ("ap", True), ("bacc", True)),
    "multiclass": (("accuracy", False), ("auroc", True), ("precision", True), ("recall", True)),
    "segmentation": (("dice", True), ("dice_present", False), ("empty_correct", False)),
}


class Scorer:
    """Test-split metrics of one scenario's weights: pooled, and per test-item ``group`` (a prepared scenario
    names each test item's site) when ``groups``. The network is the bundle's, with the run's overrides."""

    def __init__(self, bundle, data, network_overrides=None, config=None, groups: bool = True):
        from monai.data import DataLoader
        from torch.utils.data import Subset

        from .profile import load_scenario
        from .bundle import network
        from .site import test_loader

        sc = load_scenario(data, sites=[], with_test=True)
        self.task, self.classes = sc.task, sc.classes
        self.loader = test_loader(bundle, data, config=config)
        self.net = network(bundle, network_overrides or None, dataset_dir=data, class_names=list(sc.classes),
                           **(config or {}))
        self.n = len(sc.test)
        self.groups = {POOLED: self.loader}
        names = [i.get("group", i.get("site")) for i in sc.test]  # prepared scenarios name a test item's site
        if groups and any(g is not None for g in names):
            names = ["(no group)" if n is None else str(n) for n in names]
            for g in sorted(set(names)):
                idx = [i for i, n in enumerate(names) if n == g]
                self.groups[g] = DataLoader(Subset(self.loader.dataset, idx), batch_size=self.loader.batch_size,
                                            shuffle=False, num_workers=0)

    def _load(self, weights) -> None:
        from .methods.base import load_weights
        from .nets import first_of_twin

        load_weights(self.net, first_of_twin(weights))  # FedMix's two UNets: F1 is scored, as it ships

    def evaluate(self, weights) -> dict:
        """``fedlabels.site.evaluate``'s metrics of ``weights`` on the whole test split."""
        from .site import evaluate

        self._load(weights)
        return evaluate(self.net, self.loader, self.task, self.classes)

    def __call__(self, weights) -> list:
        """[(group, class, metric, value)] for every group and ``TEST_METRICS``; None where undefined."""
        from .site import evaluate

        self._load(weights)
        out = []
        for group, loader in self.groups.items():
            result = evaluate(self.net, loader, self.task, self.classes)
            for metric, per_class in TEST_METRICS[self.task]:
                if per_class:
                    for cls in self.classes:
                        value = (result.get("per_class", {}).get(cls) or {}).get(metric)
                        out.append((group, cls, metric, value))
                out.append((group, MEAN, metric, result.get(metric)))
        return out
