"""Medians of the interleaved A/B runs in a folder: python abstat.py ab-1thread"""
import re,statistics as st,glob,sys
d={}
for f in sorted(glob.glob(sys.argv[1]+'/avx2_t*_*_r*.txt')):
    side=f.split('_')[-2]
    for L in open(f):
        m=re.match(r'(torch fused fp32|\w+ \w+ state)\s+[\d.]+\s+\d+\s+[\d.]+\s+([\d.]+)',L)
        if m: d.setdefault((side,m.group(1)),[]).append(float(m.group(2)))
        m=re.search(r'triad ([\d.]+) GB/s',L)
        if m: d.setdefault((side,'triad'),[]).append(float(m.group(1)))
for mode in ['triad','torch fused fp32','fp32m bf16 state','fp32m int8 state','bf16m bf16 state','bf16m int8 state']:
    b=d.get(('B',mode)); a=d.get(('A',mode))
    print(f"{mode:20s} B {st.median(b):.3f} ({min(b):.3f}) {b}  A {st.median(a):.3f} ({min(a):.3f}) {a}")
tb=st.median(d[('B','torch fused fp32')]); ta=st.median(d[('A','torch fused fp32')])
for mode in ['fp32m bf16 state','fp32m int8 state','bf16m bf16 state','bf16m int8 state']:
    print(mode, f"B/torch {st.median(d[('B',mode)])/tb:.3f}  A/torch {st.median(d[('A',mode)])/ta:.3f}")
