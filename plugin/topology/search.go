package topology

import (
	"fmt"
	"math/bits"
	"slices"
)

// ExactLimit is the most free candidates (available GPUs not in must) for
// which Best always searches to proven optimality. Above it the search stops
// after searchBudget nodes and returns the best set found, which is never
// worse than the greedy-plus-swap answer it starts from.
const ExactLimit = 16

// searchBudget bounds the branch-and-bound nodes above ExactLimit. Each node
// costs well under a microsecond, so this keeps a 64-GPU call near 100 ms in
// the worst case; on real topologies the bound prunes far earlier.
const searchBudget = 200_000

// Best returns the best set of size GPU positions from available (a bitmask
// over positions) that contains must, in increasing order.
//
// Best maximises the set's Score. Among sets with the best score it keeps
// the GPUs left free as well connected as possible (highest Score of
// available minus the answer), so the next large request still finds a good
// set; for size 1, where every set scores 0, that alone decides. The answer
// is exact whenever at most ExactLimit candidates are free besides must.
func (s *Scorer) Best(available, must uint64, size int) ([]int, error) {
	set, _, err := s.best(available, must, size, searchBudget)
	return set, err
}

func (s *Scorer) check(available, must uint64, size int) error {
	if s.n > MaxGPUs {
		return fmt.Errorf("topology has %d GPUs, at most %d supported", s.n, MaxGPUs)
	}
	if s.n < MaxGPUs {
		if extra := available &^ (1<<s.n - 1); extra != 0 {
			return fmt.Errorf("available GPUs %v are not in the topology (%d GPUs)", positions(extra), s.n)
		}
	}
	if missing := must &^ available; missing != 0 {
		return fmt.Errorf("must-include GPUs %v are not available", positions(missing))
	}
	if size <= 0 {
		return fmt.Errorf("allocation size %d", size)
	}
	if nm := bits.OnesCount64(must); nm > size {
		return fmt.Errorf("%d must-include GPUs exceed allocation size %d", nm, size)
	}
	if na := bits.OnesCount64(available); na < size {
		return fmt.Errorf("%d GPUs available, %d requested", na, size)
	}
	return nil
}

// best is Best with an explicit node budget above ExactLimit; exact reports
// whether the answer is proven optimal.
func (s *Scorer) best(available, must uint64, size, budget int) (set []int, exact bool, err error) {
	if err := s.check(available, must, size); err != nil {
		return nil, false, err
	}
	r := size - bits.OnesCount64(must)
	if r == 0 {
		return positions(must), true, nil
	}
	if bits.OnesCount64(available) == size {
		return positions(available), true, nil
	}
	b := s.newSearch(available, must, r)
	b.greedy()
	if b.m > ExactLimit {
		b.budget = budget
	}
	b.dfs(0, r, 0, b.baseP, b.baseD)
	out := positions(must)
	for _, a := range b.best[:r] {
		out = append(out, b.c[a])
	}
	slices.Sort(out)
	return out, !b.aborted, nil
}

// search is one Best call's branch and bound. Candidates are the available
// GPUs outside must, renumbered 0..m-1 in increasing deg (then position).
//
// Objective: maximise P(S), the set score, then maximise P(A∖S), the score
// of what stays free. Since Σ_{x∈S} deg(x) = 2·P(S) + cross(S, A∖S) and
// P(A) = P(S) + P(A∖S) + cross, P(A∖S) = P(A) + P(S) − D(S) with
// D(S) = Σ_{x∈S} deg(x), deg(x) = Σ_{y∈A} w(x,y). So the tie-break is
// "minimise D", which is additive and cheap to bound.
type search struct {
	s    *Scorer
	m, r int
	c    []int   // candidate index -> position
	deg  []int64 // by candidate
	pre  []int64 // pre[k] = deg[0]+...+deg[k-1]; deg is ascending
	gain []int64 // by candidate: Σ w(c, x) over the current set
	// top[a*r+k] is the sum of the k largest w(a, b) over candidates b ≠ a.
	top []int64
	// baseP, baseD: P and D of must alone.
	baseP, baseD int64
	hasMust      bool

	cur          []int // chosen candidates, by depth
	best         []int
	bestP, bestD int64
	found        bool
	sel          []int64 // scratch for the bound's top-r selection

	nodes, budget int // budget 0: unlimited
	aborted       bool
}

func (s *Scorer) newSearch(available, must uint64, r int) *search {
	n := s.n
	avail := positions(available)
	cands := positions(available &^ must)
	m := len(cands)
	degOf := make([]int64, n)
	for _, i := range avail {
		for _, j := range avail {
			degOf[i] += s.w[i*n+j]
		}
	}
	slices.SortStableFunc(cands, func(a, b int) int {
		switch {
		case degOf[a] < degOf[b]:
			return -1
		case degOf[a] > degOf[b]:
			return 1
		}
		return a - b
	})
	b := &search{
		s: s, m: m, r: r, c: cands,
		deg:  make([]int64, m),
		pre:  make([]int64, m+1),
		gain: make([]int64, m),
		top:  make([]int64, m*r),
		cur:  make([]int, r),
		best: make([]int, r),
		sel:  make([]int64, r),
	}
	mustPos := positions(must)
	b.hasMust = len(mustPos) > 0
	for _, i := range mustPos {
		b.baseD += degOf[i]
	}
	b.baseP = s.Score(mustPos)
	row := make([]int64, 0, m)
	for a, i := range cands {
		b.deg[a] = degOf[i]
		b.pre[a+1] = b.pre[a] + degOf[i]
		for _, j := range mustPos {
			b.gain[a] += s.w[i*n+j]
		}
		row = row[:0]
		for _, j := range cands {
			if j != i {
				row = append(row, s.w[i*n+j])
			}
		}
		slices.Sort(row)
		var sum int64
		for k := 1; k < r && k <= len(row); k++ {
			sum += row[len(row)-k]
			b.top[a*r+k] = sum
		}
	}
	return b
}

func (b *search) w(a, c int) int64 { return b.s.w[b.c[a]*b.s.n+b.c[c]] }

// better reports whether (p, d) beats the incumbent.
func (b *search) better(p, d int64) bool {
	return !b.found || p > b.bestP || (p == b.bestP && d < b.bestD)
}

func (b *search) record(depth int, p, d int64) {
	copy(b.best, b.cur[:depth])
	b.bestP, b.bestD, b.found = p, d, true
}

// dfs extends the current set, which has depth chosen candidates, score p and
// deg sum d, by r more candidates from start on.
func (b *search) dfs(start, r int, depth int, p, d int64) {
	if b.budget > 0 {
		if b.nodes >= b.budget {
			b.aborted = true
			return
		}
		b.nodes++
	}
	if r == 1 {
		for a := start; a < b.m; a++ {
			if np, nd := p+b.gain[a], d+b.deg[a]; b.better(np, nd) {
				b.cur[depth] = a
				b.record(depth+1, np, nd)
			}
		}
		return
	}
	for a := start; a <= b.m-r; a++ {
		if b.prune(a, r, p, d) {
			// The bound over [a, m) also covers every later a.
			return
		}
		b.cur[depth] = a
		for x := a + 1; x < b.m; x++ {
			b.gain[x] += b.w(a, x)
		}
		b.dfs(a+1, r-1, depth+1, p+b.gain[a], d+b.deg[a])
		for x := a + 1; x < b.m; x++ {
			b.gain[x] -= b.w(a, x)
		}
		if b.aborted {
			return
		}
	}
}

// prune reports whether no r candidates from [start, m) can complete the
// current set (score p, deg sum d) into one that beats the incumbent.
//
// Score bound: for a completion T, P(S∪T) = p + Σ_{t∈T} gain(t) + ½ Σ_{t∈T}
// Σ_{u∈T∖t} w(t,u) ≤ p + ½ Σ_{t∈T} (2·gain(t) + top_{r−1}(t)), and the sum
// over T is at most the r largest such terms over [start, m). Deg bound: the
// r smallest degs in [start, m) are the first r (deg is ascending).
func (b *search) prune(start, r int, p, d int64) bool {
	if !b.found {
		return false
	}
	sel := b.sel[:0]
	for a := start; a < b.m; a++ {
		v := 2*b.gain[a] + b.top[a*b.r+r-1]
		if len(sel) < r {
			sel = append(sel, v)
			for k := len(sel) - 1; k > 0 && sel[k] > sel[k-1]; k-- {
				sel[k], sel[k-1] = sel[k-1], sel[k]
			}
			continue
		}
		if v <= sel[r-1] {
			continue
		}
		sel[r-1] = v
		for k := r - 1; k > 0 && sel[k] > sel[k-1]; k-- {
			sel[k], sel[k-1] = sel[k-1], sel[k]
		}
	}
	ub := 2 * p
	for _, v := range sel {
		ub += v
	}
	if ub < 2*b.bestP {
		return true
	}
	lbD := d + b.pre[start+r] - b.pre[start]
	return ub == 2*b.bestP && lbD >= b.bestD
}

// greedy seeds the incumbent: grow the set by the candidate with the largest
// gain (then smallest deg), from must or, when must is empty, from every
// candidate in turn; then improve each by single swaps. A good incumbent
// early is what makes the bound prune.
func (b *search) greedy() {
	seeds := []int{-1}
	if !b.hasMust {
		seeds = seeds[:0]
		for a := range b.m {
			seeds = append(seeds, a)
		}
	}
	gain := make([]int64, b.m)
	in := make([]bool, b.m)
	set := make([]int, 0, b.r)
	for _, seed := range seeds {
		copy(gain, b.gain)
		clear(in)
		set = set[:0]
		p, d := b.baseP, b.baseD
		add := func(a int) {
			p, d = p+gain[a], d+b.deg[a]
			in[a] = true
			set = append(set, a)
			for x := range b.m {
				gain[x] += b.w(a, x)
			}
		}
		if seed >= 0 {
			add(seed)
		}
		for len(set) < b.r {
			pick := -1
			for a := range b.m {
				if !in[a] && (pick < 0 || gain[a] > gain[pick] || (gain[a] == gain[pick] && b.deg[a] < b.deg[pick])) {
					pick = a
				}
			}
			add(pick)
		}
		// gain[x] is now Σ w(x, y) over the whole set (y ≠ x since w(x,x) = 0).
		for range 4 * b.r {
			bt, bu := -1, -1
			bp, bd := p, d
			for ti, t := range set {
				for u := range b.m {
					if in[u] {
						continue
					}
					np := p - gain[t] + gain[u] - b.w(t, u)
					nd := d - b.deg[t] + b.deg[u]
					if np > bp || (np == bp && nd < bd) {
						bt, bu, bp, bd = ti, u, np, nd
					}
				}
			}
			if bt < 0 {
				break
			}
			t := set[bt]
			for x := range b.m {
				gain[x] += b.w(x, bu) - b.w(x, t)
			}
			in[t], in[bu] = false, true
			set[bt] = bu
			p, d = bp, bd
		}
		if b.better(p, d) {
			copy(b.cur, set)
			b.record(b.r, p, d)
		}
	}
}
