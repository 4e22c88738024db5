"""A hospital's own rule that its batch norm never leaves it, whatever the job says.

FedBN's jobs withhold each site's batch norm with nvflare's ``ExcludeVars`` result filter, which the
job's configuration sets. A hospital that wants that guarantee for every job puts
``WithholdBatchNorm`` in its kit's ``local/privacy.json`` (``fedlabels provision --withhold-batchnorm``):
nvflare runs a site's scope filters on every reply before the job's own. The filter finds the layers from
the reply's names alone (``nets.batchnorm_keys_by_name``), so it needs neither the network nor the job.
A job that averages batch norm (FedAvg) cannot run at such a hospital: its client refuses it before round 0
(``flare.client.check_site_withholds``) rather than sending updates the server would drop.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from ..nets import batchnorm_keys_by_name

PATH = "fedlabels.flare.withhold.WithholdBatchNorm"  # how privacy.json names it


class WithholdBatchNorm(DXOFilter):
    """Removes every batch-norm layer's weights and statistics from a reply's model."""

    def __init__(self):
        kinds = [DataKind.WEIGHTS, DataKind.WEIGHT_DIFF]
        super().__init__(supported_data_kinds=kinds, data_kinds_to_filter=kinds)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        keys = batchnorm_keys_by_name(dxo.data or {})
        if not keys:
            return None  # nothing to remove: the reply goes on unchanged
        for key in keys:
            dxo.data.pop(key)
        self.log_info(fl_ctx, f"withheld {len(keys)} batch-norm entries (the site's privacy policy)")
        return dxo
