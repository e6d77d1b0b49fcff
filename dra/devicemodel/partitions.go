package devicemodel

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Counter names of a GPU's counter set. Memory slices are counted one by
// one, so that a device consumes exactly the slices of its placement and the
// scheduler never gives out two overlapping placements; compute slices and
// engines are counted as totals.
const (
	counterCompute     = "compute-slices"
	counterCopyEngines = "copy-engines"
	counterDecoders    = "decoders"
	counterEncoders    = "encoders"
	counterJPEG        = "jpeg-engines"
	counterOFA         = "ofa-engines"
)

// memorySliceCounter names memory slice k.
func memorySliceCounter(k int) string { return fmt.Sprintf("memory-slice-%d", k) }

// Dynamic describes a GPU whose MIG devices are created on demand.
type Dynamic struct {
	GPU      gpu.GPU
	Profiles mig.Profiles
	// Whole: the GPU is also offered whole (MIG mode is off and can be
	// turned on without a reset); it then consumes every counter.
	Whole bool
	// Blocked are placements taken by MIG devices no claim created: they
	// stay as they are (offered as existing MIG devices), and no partition
	// overlapping them is offered.
	Blocked []gpu.Placement
	// Offered, when set, are the only profiles offered (the config's
	// allow-list); the counter set stays the GPU's whole, since NVML places
	// the profiles offered among all of them.
	Offered []string
	// Only, when set, are the only partitions offered: a GPU kept dynamic
	// for the MIG devices claims hold on it, or an allow-list that lost a
	// profile a claim holds.
	Only []ProfileAt
	// Made are the partitions claims made or are making on the GPU: each
	// stays offered where the rules below would leave its placement out
	// (a claim's allocation names it, and the scheduler counts what it
	// consumes only while it is published).
	Made []ProfileAt
	// Closing: the GPU stops offering partitions (a surplus spare); they
	// carry TaintClosing until they go. The whole GPU does not.
	Closing bool
	// WholeClosing: the GPU offered whole is about to offer a spare layout
	// instead (migOnDemand.spareLayout): it carries TaintClosing until it
	// goes, and the layout's partitions are not offered before.
	WholeClosing bool
}

// ProfileAt is one profile at one placement: a MIG layout's instance as
// the MIG planner places it (mig.PlaceLayout).
type ProfileAt = mig.Placed

// offers reports whether dyn offers p at pl. A profile of which NVML
// allows one instance per GPU (the +me ones: the GPU has one OFA engine) is
// offered at its last placement only, where it blocks the fewest larger
// placements: one device serves every claim the GPU can hold, where one per
// placement cost the scheduler six more devices per H100 (a quarter of its
// partitions) to walk and keep, for every claim on every node.
func (dyn Dynamic) offers(p mig.Profile, pl gpu.Placement) bool {
	at := ProfileAt{Profile: p.Name, Placement: pl}
	if dyn.Only != nil {
		return slices.Contains(dyn.Only, at)
	}
	if len(dyn.Offered) > 0 && !slices.Contains(dyn.Offered, p.Name) {
		return false
	}
	return p.Info.InstanceCount != 1 || pl == p.Placements[len(p.Placements)-1] || slices.Contains(dyn.Made, at)
}

// Partitions lists, for a GPU whose MIG devices are created on demand,
// every profile it offers at every placement NVML allows that overlaps
// nothing in Blocked (a profile of one instance per GPU at one: offers),
// each consuming its memory slices, compute slices and engines from the
// GPU's counter set, and that counter set. base carries the GPU's
// attributes (and health).
func Partitions(dyn Dynamic, base Device) ([]Device, CounterSet) {
	g := dyn.GPU
	total := map[string]int64{}
	mem := 0
	for _, p := range dyn.Profiles {
		for _, pl := range p.Placements {
			mem = max(mem, pl.Start+pl.Size)
		}
		// The GPU has at least what its largest instance, or as many
		// instances of one profile as NVML allows, take together: on a
		// B200 every profile has one JPEG engine, 7g.180gb too, and seven
		// 1g instances take seven.
		n := max(int64(p.Info.InstanceCount), 1)
		total[counterCompute] = max(total[counterCompute], n*int64(p.Info.SliceCount))
		total[counterCopyEngines] = max(total[counterCopyEngines], n*int64(p.Info.CopyEngineCount))
		total[counterDecoders] = max(total[counterDecoders], n*int64(p.Info.DecoderCount))
		total[counterEncoders] = max(total[counterEncoders], n*int64(p.Info.EncoderCount))
		total[counterJPEG] = max(total[counterJPEG], n*int64(p.Info.JpegCount))
		total[counterOFA] = max(total[counterOFA], n*int64(p.Info.OfaCount))
	}
	for k := range mem {
		total[memorySliceCounter(k)] = 1
	}
	for name, v := range total {
		if v == 0 {
			delete(total, name)
		}
	}
	// An instance no claim made keeps its engines and compute slices: the
	// partitions share what is left (a 1g+me instance holds the GPU's one
	// OFA, so no +me partition fits beside it), and one that needs more
	// than is left is not offered.
	avail := maps.Clone(total)
	for _, b := range dyn.Blocked {
		if p, ok := dyn.Profiles[instanceProfileAt(g, b)]; ok {
			for name, v := range consumption(p, b) {
				if !strings.HasPrefix(name, "memory-slice-") {
					avail[name] -= v
				}
			}
		}
	}
	set := CounterSet{GPU: g.Index}

	var out []Device
	if dyn.Whole {
		d := base
		d.Name, d.Type, d.UUID, d.Index, d.MemoryBytes = GPUName(g.Index), TypeGPU, g.UUID, g.Index, g.MemoryBytes
		d.Closing = dyn.WholeClosing
		d.Consumes = total
		d.Engines = &Engines{
			Multiprocessors: maxMultiprocessors(dyn.Profiles),
			CopyEngines:     total[counterCopyEngines],
			Decoders:        total[counterDecoders],
			Encoders:        total[counterEncoders],
			JPEGEngines:     total[counterJPEG],
			OFAEngines:      total[counterOFA],
		}
		out = append(out, d)
	}
	for _, p := range dyn.Profiles {
		for _, pl := range p.Placements {
			if !dyn.offers(p, pl) || slices.ContainsFunc(dyn.Blocked, func(b gpu.Placement) bool { return b.Overlaps(pl) }) {
				continue
			}
			if exceeds(consumption(p, pl), avail) {
				continue
			}
			d := base
			d.Name, d.Type, d.Partition, d.Closing = PartitionName(g.Index, p.Name, pl.Start), TypeMIG, true, dyn.Closing
			d.Profile, d.ProfileIndex, d.Placement = p.Name, p.Index, pl
			d.ParentUUID, d.ParentIndex, d.Index = g.UUID, g.Index, -1
			d.MemoryBytes = p.Info.MemorySizeMB << 20
			d.Engines = EnginesOf(p.Info)
			d.Consumes = consumption(p, pl)
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b Device) int { return strings.Compare(a.Name, b.Name) })
	out, set.Counters = pruneCounters(out, avail)
	return out, set
}

// instanceProfileAt is the profile of g's MIG device or bare GPU instance
// at pl ("" if none).
func instanceProfileAt(g gpu.GPU, pl gpu.Placement) string {
	for _, m := range g.Instances {
		if m.Placement == pl {
			return m.Profile
		}
	}
	for _, gi := range g.GIsWithoutCI {
		if gi.Placement == pl {
			return gi.Profile
		}
	}
	return ""
}

func exceeds(use, avail map[string]int64) bool {
	for name, v := range use {
		if v > avail[name] {
			return true
		}
	}
	return false
}

// maxMultiprocessors is the most multiprocessors a profile of the GPU has:
// its full-GPU profile's, what the GPU offered whole computes with.
func maxMultiprocessors(ps mig.Profiles) int64 {
	var n int64
	for _, p := range ps {
		n = max(n, int64(p.Info.MultiprocessorCount))
	}
	return n
}

func consumption(p mig.Profile, pl gpu.Placement) map[string]int64 {
	c := map[string]int64{}
	add := func(name string, v uint32) {
		if v > 0 {
			c[name] = int64(v)
		}
	}
	add(counterCompute, p.Info.SliceCount)
	add(counterCopyEngines, p.Info.CopyEngineCount)
	add(counterDecoders, p.Info.DecoderCount)
	add(counterEncoders, p.Info.EncoderCount)
	add(counterJPEG, p.Info.JpegCount)
	add(counterOFA, p.Info.OfaCount)
	for k := pl.Start; k < pl.Start+pl.Size; k++ {
		c[memorySliceCounter(k)] = 1
	}
	return c
}

// PartitionName names the MIG device of profile at placement start on GPU
// index, e.g. "gpu-0-mig-3g40gb-4" for 3g.40gb at 4: a DNS label, stable
// whether or not the instance exists. The profiles NVIDIA names
// ("<n>g.<m>gb", then "+me", "+me.all", "+gfx" or "-me") must keep distinct
// names: "+" is spelled out, since a +me profile (with the media engines) and
// Blackwell's -me one (without them) may both be on one GPU
// ("gpu-0-mig-1g24gb-plus-me-6", "gpu-0-mig-1g24gb-me-6"); the dot of
// "<n>g.<m>gb" goes, any other dot becomes "-" ("+me.all": "-plus-me-all").
func PartitionName(index int, profile string, start int) string {
	var b strings.Builder
	p := strings.ToLower(profile)
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-':
			b.WriteByte(c)
		case c == '+':
			b.WriteString("-plus-")
		case c == '.' && i+1 < len(p) && p[i+1] >= '0' && p[i+1] <= '9':
			// "3g.40gb": the letter before the dot already separates the numbers.
		default:
			b.WriteByte('-')
		}
	}
	return fmt.Sprintf("gpu-%d-mig-%s-%d", index, b.String(), start)
}

// pruneLimit bounds the search of pruneCounters: sets of devices visited
// per counter tried. The GPUs NVIDIA makes stay far below it (a free H100
// with every profile has 1,700-odd sets that fit); past it a counter is
// kept, which is always exact.
const pruneLimit = 200_000

// pruneCounters returns the counters of total that the devices need, and
// the devices drawing on those only: a counter goes when no set of the
// devices that fits the other counters exceeds it, so the sets the
// scheduler may allocate together are exactly those the full counters
// allow, and so exactly the MIG devices NVML can hold together. Each
// counter costs the scheduler work for every device that draws on it, on
// every node, at every scheduling attempt; on an H100 the compute and
// engine totals and a memory slice are implied by the others. Engines and
// compute slices are tried first, then the memory slices from the top.
func pruneCounters(devs []Device, total map[string]int64) ([]Device, map[string]int64) {
	names := slices.SortedFunc(maps.Keys(total), func(a, b string) int {
		am, bm := strings.HasPrefix(a, "memory-slice-"), strings.HasPrefix(b, "memory-slice-")
		if am != bm {
			if am {
				return 1
			}
			return -1
		}
		if am {
			return memorySliceIndex(b) - memorySliceIndex(a)
		}
		return strings.Compare(a, b)
	})
	// use[i][c]: device i's draw on counter c, as a dense table.
	use := make([][]int64, len(devs))
	for i, d := range devs {
		use[i] = make([]int64, len(names))
		for c, name := range names {
			use[i][c] = d.Consumes[name]
		}
	}
	limits := make([]int64, len(names))
	for c, name := range names {
		limits[c] = total[name]
	}
	kept := make([]bool, len(names))
	for c := range kept {
		kept[c] = true
	}
	for c := range names {
		kept[c] = false
		if !impliedByKept(use, limits, kept) {
			kept[c] = true
		}
	}
	keep := map[string]int64{}
	for c, name := range names {
		if kept[c] {
			keep[name] = total[name]
		}
	}
	out := make([]Device, len(devs))
	for i, d := range devs {
		out[i] = d
		if d.Consumes == nil {
			continue
		}
		out[i].Consumes = map[string]int64{}
		for name, v := range d.Consumes {
			if _, ok := keep[name]; ok {
				out[i].Consumes[name] = v
			}
		}
	}
	return out, keep
}

// impliedByKept reports whether every set of devices within the limits of
// the kept counters is also within every other counter's (the one just
// dropped and those dropped before): then the kept counters allow exactly
// the sets all of them do. The search adds devices in order while the kept
// counters allow, so it visits only sets all counters allow until it finds
// one that exceeds a dropped counter.
func impliedByKept(use [][]int64, limits []int64, kept []bool) bool {
	sum := make([]int64, len(limits))
	visited := 0
	var walk func(from int) bool
	walk = func(from int) bool {
		for i := from; i < len(use); i++ {
			if visited++; visited > pruneLimit {
				return false
			}
			fits := true
			for c, v := range use[i] {
				if kept[c] && sum[c]+v > limits[c] {
					fits = false
					break
				}
			}
			if !fits {
				continue
			}
			for c, v := range use[i] {
				if !kept[c] && sum[c]+v > limits[c] {
					return false // within the kept counters, past a dropped one
				}
			}
			for c, v := range use[i] {
				sum[c] += v
			}
			ok := walk(i + 1)
			for c, v := range use[i] {
				sum[c] -= v
			}
			if !ok {
				return false
			}
		}
		return true
	}
	return walk(0)
}

func memorySliceIndex(name string) int {
	k, _ := strconv.Atoi(strings.TrimPrefix(name, "memory-slice-"))
	return k
}
