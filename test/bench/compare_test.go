package bench

import (
	"flag"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-gpuallocator/gpuallocator"

	"github.com/gpu-agent/gpu-agent/plugin/topology"
)

var (
	table = flag.String("table", "", "run the comparison and write its markdown table to this file")
	// Their policy enumerates partitions of the free GPUs, at 0.25-1.2 µs per
	// candidate set here: free-node calls estimated above this many sets
	// (about 1 s) are skipped, and partly busy ones above a tenth of it.
	maxPartitions = flag.Float64("max-partitions", 2e6, "skip go-gpuallocator calls estimated above this many candidate sets")
	worst         = flag.String("worst", "", "time our search on every mask and write the worst cases to this file")
	masks16       = flag.Int("masks16", 300, "random availability masks per size on 16-GPU nodes")
)

var profiles = []string{"dgx1-v100", "pcie-8gpu", "dgx-a100", "two-islands-16"}

// partitions estimates the work of go-gpuallocator's best-effort policy for
// m free GPUs and size k: the number of candidate sets its partition
// enumeration generates. m is padded with nil slots to a multiple of k; each
// level takes the first remaining GPU with every (k-1)-subset of the rest,
// and only sets with no padding or all of it recurse.
func partitions(m, k int) float64 {
	if k <= 1 {
		return float64(m)
	}
	pad := (k - m%k) % k
	memo := map[[2]int]float64{}
	var work func(r, p int) float64
	work = func(r, p int) float64 {
		if r+p <= k {
			return 1
		}
		key := [2]int{r, p}
		if v, ok := memo[key]; ok {
			return v
		}
		v := binom(r+p-1, k-1) + binom(r-1, k-1)*work(r-k, p)
		if p > 0 && k-1-p >= 0 {
			v += binom(r-1, k-1-p) * work(r-(k-p), 0)
		}
		memo[key] = v
		return v
	}
	return work(m, pad)
}

func binom(n, k int) float64 {
	if k < 0 || n < 0 || k > n {
		return 0
	}
	v := 1.0
	for i := range k {
		v = v * float64(n-i) / float64(i+1)
	}
	return v
}

type request struct {
	avail, must uint64
	size        int
}

type nodeUnderTest struct {
	*Node
	ours   *topology.Scorer
	theirs gpuallocator.Policy
}

func load(t testing.TB, name string) *nodeUnderTest {
	t.Helper()
	n, err := LoadNode(name)
	if err != nil {
		t.Fatal(err)
	}
	return &nodeUnderTest{Node: n, ours: topology.FromInventory(n.Inv, topology.PolicyTopology),
		theirs: gpuallocator.NewBestEffortPolicy()}
}

func mask(set []int) uint64 {
	var m uint64
	for _, i := range set {
		m |= 1 << i
	}
	return m
}

func list(m uint64) []int {
	var out []int
	for ; m != 0; m &= m - 1 {
		out = append(out, bits.TrailingZeros64(m))
	}
	return out
}

func (n *nodeUnderTest) runOurs(r request) []int {
	set, err := n.ours.Best(r.avail, r.must, r.size)
	if err != nil {
		panic(err)
	}
	return set
}

// runTheirs returns their answer as positions; ok is false when it is not a
// valid answer (nil padding entry, wrong size, must-include missing).
func (n *nodeUnderTest) runTheirs(r request) (set []int, ok bool) {
	var avail, must []*gpuallocator.Device
	for _, i := range list(r.avail) {
		avail = append(avail, n.Theirs[i])
	}
	for _, i := range list(r.must) {
		must = append(must, n.Theirs[i])
	}
	got := n.theirs.Allocate(avail, must, r.size)
	for _, d := range got {
		if d == nil {
			return nil, false
		}
		set = append(set, d.Index)
	}
	slices.Sort(set)
	m := mask(set)
	return set, len(set) == r.size && bits.OnesCount64(m) == r.size && m&^r.avail == 0 && r.must&^m == 0
}

// optimum is the best score of any valid answer, by our score and by theirs.
func (n *nodeUnderTest) optimum(r request) (ours int64, theirs int) {
	free := list(r.avail &^ r.must)
	k := r.size - bits.OnesCount64(r.must)
	ours, theirs = math.MinInt64, math.MinInt
	set := list(r.must)
	var rec func(start, left int)
	rec = func(start, left int) {
		if left == 0 {
			ours = max(ours, n.ours.Score(set))
			theirs = max(theirs, TheirScore(n.Inv.Topology, set))
			return
		}
		for a := start; a <= len(free)-left; a++ {
			set = append(set, free[a])
			rec(a+1, left-1)
			set = set[:len(set)-1]
		}
	}
	rec(0, k)
	return ours, theirs
}

// patterns are the partly busy requests for one size: every availability
// mask on 8 GPUs, a random sample of them on 16 (with at most 12 free, or
// few enough partitions, so that theirs finishes);
// each without must-include and with the lowest free GPU as must-include.
func patterns(r *rand.Rand, gpus, size int) []request {
	var avails []uint64
	full := uint64(1)<<gpus - 1
	if gpus <= 8 {
		for a := uint64(1); a < full; a++ {
			if bits.OnesCount64(a) >= size {
				avails = append(avails, a)
			}
		}
	} else {
		for a := uint64(1); a < full; a++ {
			c := bits.OnesCount64(a)
			if c >= size && (c <= 12 || partitions(c, size) <= *maxPartitions/10) {
				avails = append(avails, a)
			}
		}
		r.Shuffle(len(avails), func(i, j int) { avails[i], avails[j] = avails[j], avails[i] })
		avails = avails[:min(len(avails), *masks16)]
	}
	var out []request
	for _, a := range avails {
		out = append(out, request{a, 0, size}, request{a, a & -a, size})
	}
	return out
}

type row struct {
	profile                      string
	size                         int
	oursFree, theirsFree         time.Duration
	theirsFreeSkip               string
	oursBusyMean, oursBusyWorst  time.Duration
	theirsBusyMean               time.Duration
	theirsBusyWorst              time.Duration
	cases, theirsRun             int
	oursSubopt                   int
	theirsSubopt, theirsSubTheir int
	theirsInvalid                int
	theirsSkipped                int
}

// timeCall is the fastest of reps calls: what the code costs, without the
// scheduling noise of a shared machine.
func timeCall(reps int, f func()) time.Duration {
	best := time.Duration(math.MaxInt64)
	for range reps {
		st := time.Now()
		f()
		best = min(best, time.Since(st))
	}
	return best
}

func compare(t *testing.T, n *nodeUnderTest, size int, r *rand.Rand) row {
	gpus := len(n.Theirs)
	rw := row{profile: n.Name, size: size}
	free := request{uint64(1)<<gpus - 1, 0, size}
	rw.oursFree = timeCall(200, func() { n.runOurs(free) })
	if est := partitions(gpus, size); est <= *maxPartitions {
		rw.theirsFree = timeCall(3, func() { n.runTheirs(free) })
	} else {
		rw.theirsFreeSkip = fmt.Sprintf("skipped (~%.0g sets)", est)
	}
	// Our free-node answer is checked against brute force too.
	if got, want := n.ours.Score(n.runOurs(free)), firstOf(n.optimum(free)); got != want {
		t.Errorf("%s size %d free: ours scores %d, optimum %d", n.Name, size, got, want)
		rw.oursSubopt++
	}
	var oursSum, theirsSum time.Duration
	for _, req := range patterns(r, gpus, size) {
		rw.cases++
		optOurs, optTheirs := n.optimum(req)
		var got []int
		d := timeCall(20, func() { got = n.runOurs(req) })
		oursSum += d
		rw.oursBusyWorst = max(rw.oursBusyWorst, d)
		if n.ours.Score(got) != optOurs {
			rw.oursSubopt++
			t.Errorf("%s %+v: ours %v is not optimal", n.Name, req, got)
		}
		if partitions(bits.OnesCount64(req.avail), size) > *maxPartitions/10 {
			rw.theirsSkipped++
			continue
		}
		rw.theirsRun++
		var ok bool
		d = timeCall(1, func() { got, ok = n.runTheirs(req) })
		theirsSum += d
		rw.theirsBusyWorst = max(rw.theirsBusyWorst, d)
		switch {
		case !ok:
			rw.theirsInvalid++
		default:
			if n.ours.Score(got) != optOurs {
				rw.theirsSubopt++
			}
			if TheirScore(n.Inv.Topology, got) != optTheirs {
				rw.theirsSubTheir++
			}
		}
	}
	if rw.cases > 0 {
		rw.oursBusyMean = oursSum / time.Duration(rw.cases)
	}
	if rw.theirsRun > 0 {
		rw.theirsBusyMean = theirsSum / time.Duration(rw.theirsRun)
	}
	return rw
}

func firstOf(a int64, _ int) int64 { return a }

func pct(a, b int) string {
	if b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(a)/float64(b))
}

func ns(d time.Duration) string {
	if d == 0 {
		return "–"
	}
	return fmt.Sprintf("%d", d.Nanoseconds())
}

// TestCompare writes the side-by-side table. It only runs with -table: it
// takes minutes, most of them in go-gpuallocator.
func TestCompare(t *testing.T) {
	if *table == "" {
		t.Skip("run with -table FILE")
	}
	r := rand.New(rand.NewPCG(2026, 5))
	var b strings.Builder
	b.WriteString("| node | size | ours free (ns) | theirs free (ns) | ours busy mean (ns) | ours busy worst (ns) | theirs busy mean (ns) | theirs busy worst (ns) | requests | ours suboptimal | theirs suboptimal (our score) | theirs suboptimal (their score) | theirs invalid | theirs skipped |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, name := range profiles {
		n := load(t, name)
		gpus := len(n.Theirs)
		for size := 1; size <= gpus; size++ {
			rw := compare(t, n, size, r)
			theirsFree := ns(rw.theirsFree)
			if rw.theirsFreeSkip != "" {
				theirsFree = rw.theirsFreeSkip
			}
			fmt.Fprintf(&b, "| %s | %d | %s | %s | %s | %s | %s | %s | %d | %s | %s | %s | %s | %d |\n",
				rw.profile, rw.size, ns(rw.oursFree), theirsFree, ns(rw.oursBusyMean), ns(rw.oursBusyWorst),
				ns(rw.theirsBusyMean), ns(rw.theirsBusyWorst), rw.cases, pct(rw.oursSubopt, rw.cases),
				pct(rw.theirsSubopt, rw.theirsRun), pct(rw.theirsSubTheir, rw.theirsRun),
				pct(rw.theirsInvalid, rw.theirsRun), rw.theirsSkipped)
			t.Logf("%s size %d done", name, size)
		}
	}
	if err := os.WriteFile(*table, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestPartitionsEstimate(t *testing.T) {
	for _, tt := range []struct {
		m, k int
		want float64
	}{{4, 2, 3 + 3*1}, {2, 2, 1}, {3, 1, 3}, {3, 2, 3 + 2*1 + 1*1}, {6, 3, 10 + 10*1}} {
		if got := partitions(tt.m, tt.k); math.Abs(got-tt.want) > 0.01*tt.want {
			t.Errorf("partitions(%d, %d) = %.1f, want %.0f", tt.m, tt.k, got, tt.want)
		}
	}
}

// The issue's example: on dgx1-v100 with {1,2,3,4} free and GPU 1 required,
// theirs returns {1,4} (no NVLink) while {1,2} has two lanes.
func TestIssueExample(t *testing.T) {
	n := load(t, "dgx1-v100")
	req := request{mask([]int{1, 2, 3, 4}), 1 << 1, 2}
	if got := n.runOurs(req); !slices.Equal(got, []int{1, 2}) {
		t.Errorf("ours = %v, want [1 2]", got)
	}
	got, ok := n.runTheirs(req)
	t.Logf("theirs = %v (valid %v), their score %d vs %d for [1 2]", got, ok,
		TheirScore(n.Inv.Topology, got), TheirScore(n.Inv.Topology, []int{1, 2}))
}

func benchProfiles(b *testing.B, f func(b *testing.B, n *nodeUnderTest, req request)) {
	for _, name := range profiles {
		n := load(b, name)
		gpus := len(n.Theirs)
		for size := 1; size <= gpus; size++ {
			req := request{uint64(1)<<gpus - 1, 0, size}
			b.Run(fmt.Sprintf("%s/size=%d", name, size), func(b *testing.B) { f(b, n, req) })
		}
	}
}

// BenchmarkOursFree is one GetPreferredAllocation search on a free node.
func BenchmarkOursFree(b *testing.B) {
	benchProfiles(b, func(b *testing.B, n *nodeUnderTest, req request) {
		for b.Loop() {
			n.runOurs(req)
		}
	})
}

// BenchmarkTheirsFree is go-gpuallocator's best-effort policy on a free node;
// sizes estimated above -max-partitions are skipped.
func BenchmarkTheirsFree(b *testing.B) {
	benchProfiles(b, func(b *testing.B, n *nodeUnderTest, req request) {
		if est := partitions(bits.OnesCount64(req.avail), req.size); est > *maxPartitions {
			b.Skipf("~%.0f partitions", est)
		}
		for b.Loop() {
			n.runTheirs(req)
		}
	})
}

// TestOursWorstCase times our search on every availability mask and size
// (16-GPU nodes included: all 65535 masks) and reports the slowest request.
// It only runs with -worst FILE.
func TestOursWorstCase(t *testing.T) {
	if *worst == "" {
		t.Skip("run with -worst FILE")
	}
	var b strings.Builder
	b.WriteString("| node | requests | worst (ns) | worst request (free mask, size) | mean (ns) |\n|---|---:|---:|---|---:|\n")
	for _, name := range profiles {
		n := load(t, name)
		gpus := len(n.Theirs)
		var count int
		var sum, slowest time.Duration
		var at request
		for a := uint64(1); a < 1<<gpus; a++ {
			for size := 1; size <= bits.OnesCount64(a); size++ {
				req := request{a, 0, size}
				d := timeCall(5, func() { n.runOurs(req) })
				count++
				sum += d
				if d > slowest {
					slowest, at = d, req
				}
			}
		}
		fmt.Fprintf(&b, "| %s | %d | %d | %#x, %d | %d |\n", name, count, slowest.Nanoseconds(), at.avail, at.size,
			(sum / time.Duration(count)).Nanoseconds())
	}
	if err := os.WriteFile(*worst, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}
