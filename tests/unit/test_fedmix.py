"""FedMix, FedAdaptAgg and FedST: the rules against hand-computed arrays, the local step against a
reference loop, weak labels as the bundle renders them, and bad segmentation input."""

import copy
import json

import numpy as np
import pytest
import torch
from monai.losses import DiceLoss
from PIL import Image

from fedlabels import methods
from fedlabels.bundle.data import MaskLabeld, bundle_item
from fedlabels.data.synthetic import generate
from fedlabels.losses import soft_dice
from fedlabels.methods.base import SiteContext, Update, make_optimizer
from fedlabels.methods.fedmix import (BOX, IMAGE, NONE, PIXEL, FedMixServer, FedSTServer, adaptive_weights,
                                      dice_agreement, refine, select)
from fedlabels.nets import TwinUNet, first_of_twin
from fedlabels.profile import ScenarioError, SiteProfile, load_scenario


def t(rows):
    """A (1, 1, H, W) mask from nested lists."""
    return torch.tensor(rows, dtype=torch.float32)[None, None]


def cat(*masks):
    return torch.cat(masks)


# ---------------------------------------------------------------- refinement and selection


def test_refinement_by_box_image_tag_none_and_pixel():
    pred = t([[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    box = t([[1, 1, 1], [1, 1, 1], [0, 0, 0]])          # box over the top two rows
    present, absent = torch.ones(1, 1, 3, 3), torch.zeros(1, 1, 3, 3)
    everywhere = torch.ones(1, 1, 3, 3)
    mask = t([[0, 1, 0], [0, 1, 0], [0, 0, 0]])           # a pixel case's ground truth
    labels = cat(box, present, absent, everywhere, mask)
    level = torch.tensor([BOX, IMAGE, IMAGE, NONE, PIXEL])
    out = refine(pred.repeat(5, 1, 1, 1), labels, level)
    assert torch.equal(out[0], t([[1, 1, 0], [1, 1, 0], [0, 0, 0]])[0])   # the corner outside the box is cut
    assert torch.equal(out[1], pred[0]) and torch.equal(out[3], pred[0])  # tag "present" / no label: as is
    assert out[2].sum() == 0                                              # tag "absent": nothing
    assert torch.equal(out[4], mask[0])                                   # pixel: the mask, not the prediction


def test_refinement_by_image_tags_per_class():
    pred = torch.ones(1, 2, 2, 2)
    tag = torch.stack([torch.zeros(2, 2), torch.ones(2, 2)])[None]   # only class 1 present
    out = refine(pred, tag, torch.tensor([IMAGE]))
    assert out[0, 0].sum() == 0 and out[0, 1].sum() == 4


def test_dice_agreement_by_hand():
    a, b = t([[1, 1], [0, 0]]), t([[1, 0], [0, 0]])
    assert dice_agreement(a, b).item() == pytest.approx(2 * 1 / 3)
    empty = torch.zeros(1, 1, 2, 2)
    assert dice_agreement(empty, empty).item() == 1.0      # two empty predictions agree
    assert dice_agreement(a, empty).item() == 0.0


def test_selection_rule_by_hand():
    z = [[0, 0, 0, 0]] * 4
    box = t([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])   # 4 px
    one_px = t([[1, 0, 0, 0]] + z[1:])
    three_px = t([[1, 1, 0, 0], [1, 0, 0, 0]] + z[2:])
    half = t([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]])   # 8 px
    quarter = t([[1, 1, 0, 0], [1, 1, 0, 0]] + z[2:])                     # 4 px inside "half": dice 2*4/12
    empty, ones = torch.zeros(1, 1, 4, 4), torch.ones(1, 1, 4, 4)
    cases = [  # (r1, r2, label, level, kept at epsilon 0.9 with the box rule)
        (half, half, ones, NONE, True),            # agree
        (half, quarter, ones, NONE, False),        # dice 0.667 < 0.9
        (empty, empty, ones, NONE, True),          # two empty predictions agree
        (three_px, three_px, box, BOX, True),      # dice with the box 6/7 >= 0.5
        (one_px, one_px, box, BOX, False),         # dice with the box 2/5 < 0.5
        (empty, empty, box, BOX, False),           # empty inside a real box: not kept
        (empty, empty, empty, BOX, True),          # a lesion-free box case (no box): agreement
        (empty, empty, empty, IMAGE, False),       # tagged background-only: drops out
        (half, half, ones, IMAGE, True),           # tagged present, agree
        (half, empty, t([[0, 1, 0, 0]] + z[1:]), PIXEL, True),   # pixel cases are always kept
    ]
    r1 = cat(*[c[0] for c in cases])
    r2 = cat(*[c[1] for c in cases])
    label = cat(*[c[2] for c in cases])
    level = torch.tensor([c[3] for c in cases])
    assert select(r1, r2, label, level, 0.9).tolist() == [c[4] for c in cases]
    # without the box rule the two box cases that agree are kept; epsilon 0.6 admits the 0.667 pair
    no_box = select(r1, r2, label, level, 0.9, box_rule=False).tolist()
    assert no_box[4] and no_box[5] and not no_box[1]
    assert select(r1, r2, label, level, 0.6).tolist()[1]
    # epsilon 0 (Table V's "w/o selection") keeps every case but the background-only tag and the box rule's
    assert select(r1, r2, label, level, 0.0, box_rule=False).tolist() == [True] * 7 + [False] + [True] * 2


# ---------------------------------------------------------------- losses and weights


def test_soft_dice_is_monais_dice_loss_and_masks_by_hand():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(3, 2, 5, 5, generator=g), (torch.rand(3, 2, 5, 5, generator=g) > 0.5).float()
    assert soft_dice(logits, target).mean().item() == pytest.approx(DiceLoss(sigmoid=True)(logits, target).item(), abs=1e-6)
    # masked: only the unmasked pixels count. p = sigmoid(0) = 0.5 everywhere; target [1, 0 | 1, 1], mask [1, 1 | 0, 0]
    logit = torch.zeros(1, 1, 2, 2)
    target, mask = t([[1, 0], [1, 1]]), t([[1, 1], [0, 0]])
    # sums over the two kept pixels: p.t = 0.5, p = 1.0, t = 1 -> 1 - (1 + s) / (2 + s)
    assert soft_dice(logit, target, mask).item() == pytest.approx(1 - (1 + 1e-5) / (2 + 1e-5))


def test_adaptive_weights_by_hand_and_lam_zero_is_count_weighting():
    # c = (10, 30) / 40 = (0.25, 0.75); L^1.5 = (0.353553, 0.125), d = (0.738796, 0.261204)
    # w ~ c + 10 d = (7.637962, 3.362038), normalised by 11
    w = adaptive_weights([10, 30], [0.5, 0.25], lam=10, beta=1.5)
    assert w == pytest.approx([7.637962 / 11, 3.362038 / 11], abs=1e-6)
    assert adaptive_weights([10, 30], [0.5, 0.25], lam=0, beta=1.5) == pytest.approx([0.25, 0.75])
    assert adaptive_weights([10, 30], [0.0, 0.0], lam=10, beta=3) == pytest.approx([0.25, 0.75])  # no loss to tell apart
    assert adaptive_weights([0, 30], [0.9, 0.2], lam=1, beta=1)[0] == pytest.approx(0.9 / 1.1 / 2)  # c = 0, d only
    with pytest.raises(ValueError, match="at least one site"):
        adaptive_weights([0, 0], [0.5, 0.5], lam=1, beta=1)


def test_adaptive_server_weighs_f1_and_f2_alike():
    server = FedMixServer(lam=10, beta=1.5)
    server.setup({"a": {"supervision": "pixel", "labeled": True}, "b": {"supervision": "none", "labeled": False}})
    ups = [Update("a", {"f1.w": np.array([1.0]), "f2.w": np.array([2.0])}, 10, metrics={"train_loss": 0.5}),
           Update("b", {"f1.w": np.array([3.0]), "f2.w": np.array([6.0])}, 30, metrics={"train_loss": 0.25})]
    out = server.aggregate(ups, {"f1.w": np.array([0.0]), "f2.w": np.array([0.0])}, 0)
    w = np.array([7.637962, 3.362038]) / 11
    assert out["f1.w"][0] == pytest.approx(w @ [1.0, 3.0], abs=1e-5)
    assert out["f2.w"][0] == pytest.approx(w @ [2.0, 6.0], abs=1e-5)   # the same weights for F1 and F2
    assert server.take_notes() == ["adaptive weights: a 0.694 (n=10, loss=0.500), b 0.306 (n=30, loss=0.250)"]
    with pytest.raises(ValueError, match="train_loss"):
        server.aggregate([Update("a", {}, 3, metrics={})], {}, 1)


@pytest.mark.parametrize("server", [FedMixServer(), FedSTServer()])
def test_methods_that_pseudo_label_need_a_pixel_labeled_site(server):
    summaries = {"site-1": {"supervision": "bbox", "labeled": True}, "site-2": {"supervision": "none", "labeled": False}}
    with pytest.raises(ValueError, match="at least one site with pixel-level masks.*untrained model"):
        server.setup(summaries)
    server.setup({**summaries, "site-3": {"supervision": "pixel", "labeled": True}})


# ---------------------------------------------------------------- the local step


def tiny_twin(fg1: bool, fg2: bool) -> TwinUNet:
    """A small TwinUNet whose F1 / F2 predict (nearly) all foreground or all background."""
    torch.manual_seed(0)
    net = TwinUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    with torch.no_grad():
        for f, fg in ((net.f1, fg1), (net.f2, fg2)):
            f.final_conv.weight.mul_(0.01)
            f.final_conv.bias.fill_(8.0 if fg else -8.0)
    return net


def ctx_for(batches, supervision="none"):
    profile = SiteProfile("s", "segmentation", ("lesion",), ("lesion",), supervision)
    return SiteContext(profile, batches, {"supervision": supervision, "labeled": True, "cases": 2})


def batch(level=NONE, n=2):
    g = torch.Generator().manual_seed(1)
    return {"image": torch.rand(n, 1, 16, 16, generator=g), "label": torch.ones(n, 1, 16, 16),
            "level": torch.full((n,), level)}


def test_fedmix_site_that_keeps_nothing_abstains_and_does_not_train():
    net = tiny_twin(True, False)  # F1 all foreground, F2 all background: they never agree
    before = copy.deepcopy(net.state_dict())
    client = methods.get("fedmix").make_client(net, ctx_for([batch()]))
    update = client.train(before, 0)
    assert update.abstain and update.n == 0 and update.weights == {} and update.metrics["kept_cases"] == 0
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_fedmix_step_is_cross_pseudo_supervision():
    """F1 learns from F2's refined label and F2 from F1's: a reference loop with the pairing, and
    the swapped pairing giving other weights."""
    net = tiny_twin(True, False)
    start = copy.deepcopy(net.state_dict())
    b = batch()
    client = methods.get("fedmix").make_client(net, ctx_for([b]), epsilon=0.0, optimizer="sgd", lr=0.5)
    update = client.train(start, 0)
    assert not update.abstain and update.n == 2 and update.metrics["kept_fraction"] == 1.0

    def reference(swap: bool):
        ref = TwinUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
        ref.load_state_dict(start)
        x = b["image"]
        r1 = torch.ones_like(b["label"])    # F1 (received) says foreground everywhere, refined by "none": as is
        r2 = torch.zeros_like(b["label"])   # F2 says background
        t1, t2 = (r1, r2) if swap else (r2, r1)
        opt = make_optimizer("sgd", list(ref.parameters()), 0.5)
        opt.zero_grad()
        (soft_dice(ref.f1(x), t1).mean() + soft_dice(ref.f2(x), t2).mean()).backward()
        opt.step()
        return ref.state_dict()

    # the pseudo labels came from the received networks, kept frozen while the site trained
    assert all(torch.equal(v, start[k]) for k, v in client.teacher.state_dict().items())
    assert not any(p.requires_grad for p in client.teacher.parameters())
    want, swapped = reference(False), reference(True)
    for k, v in update.weights.items():
        np.testing.assert_allclose(v, want[k].numpy(), atol=1e-6, err_msg=k)
    assert any(not np.allclose(update.weights[k], swapped[k].numpy(), atol=1e-6) for k in update.weights)
    # the reported loss is the two networks' mean soft Dice
    assert update.metrics["train_loss"] == pytest.approx(float(
        (soft_dice(tiny_twin(True, False).f1(b["image"]), torch.zeros(2, 1, 16, 16)).mean()
         + soft_dice(tiny_twin(True, False).f2(b["image"]), torch.ones(2, 1, 16, 16)).mean()) / 2), abs=1e-5)


def test_fedmix_needs_the_twin_network():
    from fedlabels.nets import GroupNormUNet

    with pytest.raises(ValueError, match="fedlabels.nets.TwinUNet"):
        methods.get("fedmix").make_client(GroupNormUNet(in_channels=1), ctx_for([batch()]))
    assert methods.get("fedmix").network_options({"features": [8] * 6}) == {
        "_target_": "fedlabels.nets.TwinUNet", "features": [8] * 6}


def test_fedst_warms_up_on_masks_then_trains_on_confident_pixels():
    torch.manual_seed(0)
    from fedlabels.nets import GroupNormUNet

    net = GroupNormUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    start = copy.deepcopy(net.state_dict())
    b = batch(NONE)
    client = methods.get("fedst").make_client(net, ctx_for([b]), optimizer="sgd", lr=0.5, confidence=0.6)
    assert client.train(start, 0, {"self_training": False}).abstain   # warm-up: nothing with a mask here
    update = client.train(start, 1, {"self_training": True})
    assert update.n == 2
    ref = GroupNormUNet(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    ref.load_state_dict(start)
    with torch.no_grad():
        p = torch.sigmoid(ref(b["image"]))
    target, mask = (p > 0.5).float(), ((p >= 0.6) | (p <= 0.4)).float()
    assert 0 < mask.mean() < 1   # some pixels are confident, some not: the mask matters here
    opt = make_optimizer("sgd", list(ref.parameters()), 0.5)
    soft_dice(ref(b["image"]), target, mask).mean().backward()
    opt.step()
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(update.weights[k], v.numpy(), atol=1e-6, err_msg=k)


# ---------------------------------------------------------------- weak labels in the bundle


def test_weak_labels_render_on_the_image_grid(tmp_path):
    image = {"image": torch.zeros(3, 6, 4)}   # channel-first, x = 6, y = 4 (MONAI's order)
    tf = MaskLabeld(keys="label", num_classes=2)
    box = tf({**image, "label": {"level": "bbox", "boxes": [[1, 0, 3, 2, 1]]}})["label"]
    want = torch.zeros(2, 6, 4)
    want[1, 1:3, 0:2] = 1      # x0:x1, y0:y1 of class 1
    assert torch.equal(box, want)
    tag = tf({**image, "label": {"level": "image", "classes": [0]}})["label"]
    assert tag[0].sum() == 24 and tag[1].sum() == 0
    assert tf({**image, "label": {"level": "none"}})["label"].sum() == 48
    # a two-class mask file (value = class + 1) becomes one channel per class
    arr = np.zeros((4, 6), np.uint8)   # PIL: rows are y
    arr[0, 1], arr[3, 5] = 1, 2
    Image.fromarray(arr).save(tmp_path / "m.png")
    m = tf({**image, "label": str(tmp_path / "m.png")})["label"]
    assert m.shape == (2, 6, 4) and m[0, 1, 0] == 1 and m[1, 5, 3] == 1 and m.sum() == 2
    with pytest.raises(ValueError, match=r"m.png: mask of \(6, 4\) pixels, its image \(5, 4\)"):
        tf({"image": torch.zeros(3, 5, 4), "label": str(tmp_path / "m.png")})
    arr[arr > 0] = 255  # a binary 0/255 mask given to a two-class network
    Image.fromarray(arr).save(tmp_path / "b.png")
    with pytest.raises(ValueError, match=r"b.png: mask values up to 255; a mask of 2 classes holds class index \+ 1"):
        tf({**image, "label": str(tmp_path / "b.png")})


def test_every_case_of_a_mixed_site_reaches_the_loader_with_its_level():
    item = {"image": "a.png", "supervision": "bbox", "boxes": [[0, 0, 2, 2, 0]]}
    assert bundle_item(item, "segmentation", labeled_only=True) is None
    assert bundle_item(item, "segmentation", labeled_only=False) == {
        "image": "a.png", "label": {"level": "bbox", "boxes": [[0, 0, 2, 2, 0]]}, "level": BOX}
    assert bundle_item({"image": "a.png", "seg": "m.png"}, "segmentation", labeled_only=False)["level"] == PIXEL


def test_two_class_lesion_flavour_tags_and_boxes_follow_the_masks(tmp_path):
    root = generate("lesion", tmp_path / "l2", seed=0, sites=3, size=32, cases=10, test_cases=4, lesion_classes=2)
    sc = load_scenario(root)
    assert sc.classes == ("pigmented", "vascular")
    for name, level in (("site-2", "bbox"), ("site-3", "image")):
        site = sc.site(name)
        for item, oracle in zip(site.training, site.oracle()["training"]):
            m = np.asarray(Image.open(oracle["seg"]))
            present = [c for c in range(2) if (m == c + 1).any()]
            if level == "image":
                assert item["classes"] == present
            else:
                assert [b[4] for b in item["boxes"]] == present
                for x0, y0, x1, y1, c in item["boxes"]:
                    ys, xs = np.nonzero(m == c + 1)
                    assert x0 <= xs.min() and y0 <= ys.min() and xs.max() < x1 and ys.max() < y1
    seen = set()
    for site in sc.sites.values():
        for o in site.oracle()["training"]:
            seen |= set(np.unique(np.asarray(Image.open(o["seg"]))).tolist())
    assert seen == {0, 1, 2}


# ---------------------------------------------------------------- bad input


@pytest.fixture()
def mixed(tmp_path):
    return generate("lesion", tmp_path / "mixed", seed=0, sites=4, size=16, cases=4, test_cases=4)


def edit(root, site, fn):
    path = root / site / "datalist.json"
    doc = json.loads(path.read_text())
    fn(doc["training"][0])
    path.write_text(json.dumps(doc))
    return path


def test_bad_segmentation_input_is_one_error_naming_file_and_field(mixed):
    from PIL import Image as PILImage

    path = edit(mixed, "site-2", lambda it: it.update(boxes=[[0, 0, 17, 8, 0]]))
    with pytest.raises(ScenarioError, match=r"site-2/datalist.json.*training\[0\].*boxes.*outside the 16x16 image"):
        load_scenario(mixed)
    path.write_text(path.read_text().replace("17", "8"))
    path = edit(mixed, "site-3", lambda it: it.update(classes=[1]))
    with pytest.raises(ScenarioError, match=r"site-3/datalist.json.*training\[0\].*classes.*0\.\.0"):
        load_scenario(mixed)
    edit(mixed, "site-3", lambda it: it.update(classes=[0]))
    seg_path = edit(mixed, "site-1", lambda it: None)
    first = json.loads(seg_path.read_text())["training"][0]
    PILImage.fromarray(np.zeros((12, 16), np.uint8)).save(mixed / "site-1" / first["seg"])
    with pytest.raises(ScenarioError, match=r"site-1/datalist.json.*training\[0\].*seg.*mask is \(16, 12\) pixels"):
        load_scenario(mixed)
    edit(mixed, "site-1", lambda it: it.pop("seg"))
    with pytest.raises(ScenarioError, match=r"site-1/datalist.json.*training\[0\].*seg.*missing"):
        load_scenario(mixed)
    edit(mixed, "site-1", lambda it: it.update(seg=first["seg"]))
    PILImage.fromarray(np.zeros((16, 16), np.uint8)).save(mixed / "site-1" / first["seg"])
    load_scenario(mixed)  # valid again
    # a mask on a box case would reach training as its label
    edit(mixed, "site-2", lambda it: it.update(seg=first["seg"]))
    with pytest.raises(ScenarioError, match=r"site-2/datalist.json.*training\[0\].*seg.*'bbox' case carries a mask"):
        load_scenario(mixed)


def test_fedmix_without_a_pixel_site_fails_before_training(tmp_path):
    from fedlabels import references

    root = generate("lesion", tmp_path / "nopix", seed=0, sites=2, size=16, cases=4, test_cases=4,
                    supervision=["bbox", "none"])
    setups = references.setups("lesion_unet", root, method="fedmix", config={"image_size": 16})
    with pytest.raises(ValueError, match="fedmix needs at least one site with pixel-level masks"):
        references.federate("fedmix", setups, 1, log=None)
    assert {k.split(".")[0] for k in setups["site-1"].net.state_dict()} == {"f1", "f2"}
    assert set(first_of_twin(setups["site-1"].net.state_dict())) == {
        k[3:] for k in setups["site-1"].net.state_dict() if k.startswith("f1.")}


def test_fedmix_trains_on_the_two_class_flavour(tmp_path):
    from fedlabels import references

    root = generate("lesion", tmp_path / "l2", seed=0, sites=3, size=16, cases=8, test_cases=4, lesion_classes=2,
                    supervision=["pixel", "bbox", "image"])
    setups = references.setups("lesion_unet", root, method="fedmix", config={"image_size": 16})
    b = next(iter(setups["site-3"].train_loader))
    assert b["label"].shape[1:] == (2, 16, 16) and set(b["level"].tolist()) == {IMAGE}
    out = references.federate("fedmix", setups, 1, log=None, client_options={"epsilon": 0.0})
    rec = out["records"][0]
    assert rec["aggregated"] and rec["sites"]["site-1"]["n"] == len(setups["site-1"].site.training)
    # epsilon 0 keeps every image-level case but those tagged background-only
    tagged = sum(bool(i["classes"]) for i in setups["site-3"].site.training)
    assert rec["sites"]["site-3"]["n"] == tagged


def test_masks_from_probabilities_per_class_threshold_by_hand():
    from fedlabels.bundle.data import MaskFromProbabilitiesd

    p = torch.tensor([[[0.6, 0.2], [0.7, 0.95]], [[0.9, 0.1], [0.5, 0.85]]])   # class 0, class 1
    out = MaskFromProbabilitiesd("pred", [0.5, 0.8])({"pred": p})["pred"]
    # (0,0) both reach their threshold, class 1 more probable; (0,1) neither; (1,0) class 0 only;
    # (1,1) both, class 0 more probable
    assert out.tolist() == [[[2.0, 0.0], [1.0, 1.0]]]
    one = MaskFromProbabilitiesd("pred", [0.5])({"pred": torch.tensor([[[0.5, 0.4]]])})["pred"]
    assert one.tolist() == [[[1.0, 0.0]]]


def test_a_two_class_bundle_writes_label_maps(tmp_path):
    from monai.bundle import run

    from fedlabels.bundle.workflows import export_bundle
    from fedlabels.nets import GroupNormUNet

    root = generate("lesion", tmp_path / "l2", seed=0, sites=2, size=32, cases=4, test_cases=3, lesion_classes=2)
    torch.manual_seed(0)
    torch.save(GroupNormUNet(out_channels=2).state_dict(), tmp_path / "m.pt")
    exp = export_bundle("lesion_unet", tmp_path / "m.pt", tmp_path / "exp", class_names=["pigmented", "vascular"],
                        image_size=32)
    run(config_file=str(exp / "configs" / "inference.json"), meta_file=str(exp / "configs" / "metadata.json"),
        logging_file=False, bundle_root=str(exp), dataset_dir=str(root / "test" / "images"),
        output_dir=str(tmp_path / "out"), device="cpu")
    masks = sorted((tmp_path / "out").glob("*_seg.png"))
    assert len(masks) == 3
    values = set()
    for m in masks:
        arr = np.asarray(Image.open(m))
        assert arr.shape == (32, 32)
        values |= set(np.unique(arr).tolist())
    assert values <= {0, 1, 2} and len(values) > 1


def test_twin_unet_starts_only_from_a_checkpoint_of_two_networks(tmp_path):
    from fedlabels.nets import GroupNormUNet

    small = dict(in_channels=1, features=(4, 4, 4, 4, 4, 4), num_groups=2)
    torch.save(GroupNormUNet(**small).state_dict(), tmp_path / "one.pt")
    with pytest.raises(ValueError, match="one.pt: TwinUNet starts from a checkpoint of two networks"):
        TwinUNet(**small, init_ckpt=str(tmp_path / "one.pt"))
    torch.manual_seed(3)
    saved = TwinUNet(**small)
    torch.save(saved.state_dict(), tmp_path / "two.pt")
    loaded = TwinUNet(**small, init_ckpt=str(tmp_path / "two.pt"))
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in loaded.state_dict().items())
