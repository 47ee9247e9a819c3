"""Where the built-in kernel configs' measured values come from (the `source` of their
entries in configs.py), kept apart so the table stays readable."""

SM_90 = (
    'measured by luceio.kernels.tune on NVIDIA H200 (sm_90), bf16, triton 3.6.0, torch '
    '2.11.0+cu130, 2026-11-30; qgemm_*: one-field sweeps of bench/qgemm.py --quick around the'
    ' defaults, same card; gemv_*: bench/gemv_sweep.py (best geometric mean over q4_k, q6_k, '
    'q8_0, q5_0; results/h200/gemv_sweep.json), 2026-12-01; decode_min_tokens_per_split 256 '
    '-> 64: GPU time of a batch-1 decode step 945 -> 853 us (0.5B Q4_K_M, ctx 512), 2792 -> '
    '2677 us (7B), 978 -> 944 us (0.5B, ctx 8192), bench/step_profile.py --set '
    '(results/h200/split_ab_*.json); gemv split 256 -> 4224 programs (32 warps per SM), >= 1 '
    'tile: GEMV time of a decode step 2082 -> 1934 us (7B Q4_K_M), 458 -> 422 us (0.5B), '
    'results/h200/split_ab_gemv.json; pdl on: 7B Q4_K_M 410 -> 431 tok/s, GPU idle 9.6 -> '
    '4.8% of a step, 2026-12-02, results/h200/step_profile_pdl.json; dense_gemv_*: '
    'bench/dense_gemv_sweep.py (best geometric mean over 12 bf16 projections of 3 models; the'
    " wide tile: best on the gate/up matrices; the 0.5B's LM head took 76 us against cuBLAS's"
    ' 66, hence max_n), results/h200/dense_gemv_sweep_m1*.json, 2026-12-02; moe_decode_*: '
    "bench/moe_decode_sweep.py (one token's top-8 experts in a CUDA graph, geometric mean "
    'over the Qwen3.5-35B-A3B and Qwen3-30B-A3B layer shapes: 0.23 -> 0.70 of copy '
    'bandwidth), results/h200/moe_decode_sweep_session20.json, 2026-12-03; '
    'decode_num_warps_wide 8 (head_dim >= 128): bench/decode_attn_sweep.py (batch 1, ctx 512 '
    'and 8192, in a CUDA graph: head_dim 256 at ctx 512 11.8 -> 7.9 us, 1.5B 7.2 -> 5.6 us), '
    'results/h200/decode_attn_sweep_session20.json; in the engine 8 warps gave 1.5B 645.9 -> '
    '668.4 tok/s but 0.5B (head_dim 64) 1306.5 -> 1250.2, hence head_dim 64 keeps 2, '
    'results/h200/step_profile_session20_decode_warps_ab.json, 2026-12-03; '
    'prefill_split_max_programs 32: bench/tree_verify_cost.py, 1.5B Q4_K_M ctx 512, off -> on'
    ' at 64: batch 1 chain k=4 verify 2.83 -> 2.52 ms, tree of 22 4.24 -> 4.05; batch 16 '
    'chain k=4 (32 programs) 4.70 -> 4.50, tree of 16 (64 programs) 5.73 -> 6.00, hence 32, '
    'results/h200/tree_verify_cost_session21_split_*.json, 2026-12-04; dense_gemv_deep_*: '
    "session 13's sweep per matrix (0.5B / 1.5B down 6.71 -> 6.11, 12.98 -> 10.87 us; the "
    "8B's 29.6 -> 36.0, hence the element bound), in the engine GPU busy 739.8 -> 704.2 us "
    '(0.5B), 1490.4 -> 1415.6 (1.5B), results/h200/step_profile_session21_deep_ab.json; '
    'skinny_max_m 16 -> 32, skinny_max_m_q6_k 8 (q6_k: dequantize + cuBLAS past 8 rows; 7B '
    'down at 16 rows 142 us in the tl.dot tile, 109 dequantized, '
    'results/h200/gemv_mma_pergroup_session22.json): bench/tree_verify_cost.py, 1.5B Q4_K_M, '
    'batch 1, three off/on runs: 9 rows 4.06 -> 3.90 ms, 17 rows 4.29 -> 4.24, 23 rows 4.30 '
    '-> 4.10 (means), results/h200/tree_verify_cost_session22_skinny_*, 2026-12-04; '
    'gemv_row_blocks 2 (rows in two blocks, 5 = 4 + 1; then the flag gemv_row_split): '
    'bench/tree_verify_cost.py --ab '
    'gemv_row_split=true, batch 1 Q4_K_M, three alternating rounds: 7B chain k=4 verify 5.81 '
    '-> 4.33 ms, k=2 4.10 -> 3.51; 1.5B 2.72 -> 2.23, 2.12 -> 1.97; '
    'results/h200/tree_verify_row_split_*.json, gemv_rows_split_session23.json, 2026-12-04'
    '; gemv_rows_prefetch off: bench/gemv_sweep.py --rows (q4_k 4 / 6 / 8 rows 20.6 -> 24.7, '
    '16.7 -> 20.2, 14.9 -> 15.9% of copy; 5 rows 21.6 -> 20.6; '
    'results/h200/gemv_rows_prefetch_session23.json); 7B Q4_K_M decode at batch 8 6.14 -> '
    '5.71 ms a step, batch 1 chain k=2 verify 3.52 -> 3.31, k=4 4.32 -> 4.43 (two alternating'
    ' rounds, results/h200/tree_verify_rows_prefetch_7b.json), 2026-12-04'
)
