#!/bin/bash
# IsoFed pretraining readings, PneumoniaMNIST gamma 0.8, L:U 1:3, the isofed preset, splits 0-2 (resumable: bench keeps finished cells)
cd "$(dirname "$0")/../../../.."  # the repository root
D=benchmarks/results/isofed-preset/data/pneumoniamnist-g0.8-l1-s{seed}
A=benchmarks/results/isofed-preset/ablations
run() { name=$1; shift; echo "[abl] $name start $(date +%T)"; OMP_NUM_THREADS=1 nice -n 10 .venv/bin/fedlabels bench --data "$D" --protocol isofed --rounds 20 --seeds 0,1,2 --eval-rounds 5,10,20 --out $A/pneumoniamnist-g0.8-l1-$name "$@" >> $A/pneumoniamnist-g0.8-l1-$name.log 2>&1; echo "[abl] $name exit $? $(date +%T)"; }
run baseline --methods isofed,isofed_nopt
run teacher --methods isofed --opt isofed:pretrain_target=teacher
run allsites --methods isofed --opt isofed:pretrain_sites=all
run lr1e-4 --methods isofed --opt isofed:pretrain_lr=0.0001
run epochs3 --methods isofed --opt isofed:pretrain_epochs=3
