package agent

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Node labels gpu-agent owns. Their names and value formats are GPU feature
// discovery's, so nodeSelectors and affinities written for NVIDIA's stack
// keep matching; nvidia.com/mig.config.state is mig-manager's.
const (
	LabelPresent        = "nvidia.com/gpu.present"
	LabelProduct        = "nvidia.com/gpu.product"
	LabelCount          = "nvidia.com/gpu.count"
	LabelMemory         = "nvidia.com/gpu.memory"
	LabelFamily         = "nvidia.com/gpu.family"
	LabelComputeMajor   = "nvidia.com/gpu.compute.major"
	LabelComputeMinor   = "nvidia.com/gpu.compute.minor"
	LabelMode           = "nvidia.com/gpu.mode"
	LabelMIGCapable     = "nvidia.com/mig.capable"
	LabelMIGStrategy    = "nvidia.com/mig.strategy"
	LabelMPSCapable     = "nvidia.com/mps.capable"
	LabelSharing        = "nvidia.com/gpu.sharing-strategy"
	LabelReplicas       = "nvidia.com/gpu.replicas"
	LabelMIGConfigState = "nvidia.com/mig.config.state"
	labelDriverFull     = "nvidia.com/cuda.driver-version.full"
)

// LabelClique is the NVLink clique of a fabric-attached node's GPUs
// ("<cluster UUID>.<clique id>"), as NVIDIA's DRA driver sets it.
const LabelClique = "nvidia.com/gpu.clique"

// mig.config.state values, as mig-manager sets them.
const (
	MIGConfigPending = "pending"
	MIGConfigSuccess = "success"
	MIGConfigFailed  = "failed"
)

// NodeLabels derives the labels the node should carry from what it offers:
// the inventory, the config in force and each GPU's
// MIG state. It is pure. A node without GPUs gets no labels at all (not even
// gpu.present=false), so that an uninstall-like state removes them.
func NodeLabels(inv *gpu.Inventory, cfg config.Selected, migStates []MIGState) map[string]string {
	if inv == nil || len(inv.GPUs) == 0 {
		return nil
	}
	l := map[string]string{LabelPresent: "true", LabelMode: "compute"}
	g := representative(inv.GPUs)
	product := labelValue(strings.ReplaceAll(g.Name, " ", "-"))
	l[LabelCount] = strconv.Itoa(len(inv.GPUs))
	l[LabelMemory] = strconv.FormatUint(g.MemoryBytes>>20, 10)
	if cc := g.ComputeCapability; cc.Major > 0 {
		l[LabelComputeMajor] = strconv.Itoa(cc.Major)
		l[LabelComputeMinor] = strconv.Itoa(cc.Minor)
		if f := cc.Family(); f != "" {
			l[LabelFamily] = f
		}
	}
	capable := slices.ContainsFunc(inv.GPUs, func(g gpu.GPU) bool { return g.MIGCapable })
	l[LabelMIGCapable] = strconv.FormatBool(capable)
	strategy := config.MIGStrategyNone
	if cfg.Config != nil {
		strategy = cmp.Or(cfg.Config.MIG.Strategy, config.MIGStrategyNone)
	}
	if capable {
		l[LabelMIGStrategy] = string(strategy)
	}

	sharing, replicas := sharingOf(cfg)
	l[LabelSharing], l[LabelReplicas] = sharing, strconv.Itoa(replicas)
	l[LabelMPSCapable] = strconv.FormatBool(sharing == "mps")
	if sharing != "none" && !renamed(cfg) {
		product += "-SHARED"
	}

	// MIG devices by profile, from what is offered.
	type profileInfo struct{ count, memMiB, slices int }
	profiles := map[string]*profileInfo{}
	for _, gg := range inv.GPUs {
		if !gg.MIG.Current {
			continue
		}
		for _, in := range gg.Instances {
			p := profiles[in.Profile]
			if p == nil {
				p = &profileInfo{memMiB: int(in.MemoryBytes >> 20), slices: sliceCount(in.Profile)}
				profiles[in.Profile] = p
			}
			p.count++
		}
	}
	switch strategy {
	case config.MIGStrategyMixed:
		for name, p := range profiles {
			key := strings.TrimPrefix(MIGResourceName(name), "nvidia.com/")
			l["nvidia.com/"+key+".count"] = strconv.Itoa(p.count)
			l["nvidia.com/"+key+".memory"] = strconv.Itoa(p.memMiB)
			if p.slices > 0 {
				l["nvidia.com/"+key+".slices.gi"] = strconv.Itoa(p.slices)
				l["nvidia.com/"+key+".slices.ci"] = strconv.Itoa(p.slices)
			}
		}
	case config.MIGStrategySingle:
		if len(profiles) == 1 {
			for name, p := range profiles {
				product += "-MIG-" + name
				l[LabelCount] = strconv.Itoa(p.count)
				l[LabelMemory] = strconv.Itoa(p.memMiB)
				if p.slices > 0 {
					l["nvidia.com/gpu.slices.gi"] = strconv.Itoa(p.slices)
					l["nvidia.com/gpu.slices.ci"] = strconv.Itoa(p.slices)
				}
			}
		}
	}
	l[LabelProduct] = labelValue(product)

	if v := inv.DriverVersion; v != "" {
		l[labelDriverFull] = labelValue(v)
		parts := strings.SplitN(v, ".", 3)
		names := []string{"major", "minor", "revision"}
		old := []string{"major", "minor", "rev"}
		for i, p := range parts {
			if p == "" || !isDigits(p) {
				continue
			}
			l["nvidia.com/cuda.driver-version."+names[i]] = p
			l["nvidia.com/cuda.driver."+old[i]] = p
		}
	}
	if st := migConfigState(migStates); st != "" {
		l[LabelMIGConfigState] = st
	}
	if c := clique(inv.GPUs); c != "" {
		l[LabelClique] = c
	}
	return l
}

// clique is the GPUs' NVLink clique when all are in the same complete
// one; "" otherwise (no fabric, a registration not complete, or GPUs that
// disagree: a node in two cliques is labelled in neither).
func clique(gpus []gpu.GPU) string {
	c := gpus[0].Fabric.Clique()
	for _, g := range gpus[1:] {
		if g.Fabric.Clique() != c {
			return ""
		}
	}
	return c
}

// migConfigState is mig-manager's summary: failed if any GPU failed,
// pending while any has not reached the layout, success once all have. No
// states (no layout in force): no label.
func migConfigState(states []MIGState) string {
	if len(states) == 0 {
		return ""
	}
	st := MIGConfigSuccess
	for _, s := range states {
		switch s.Phase {
		case mig.PhaseFailed:
			return MIGConfigFailed
		case mig.PhaseApplied:
		default:
			st = MIGConfigPending
		}
	}
	return st
}

// representative is the GPU model the node-wide labels describe: the most
// common one (GFD assumes a node has one model).
func representative(gpus []gpu.GPU) gpu.GPU {
	count := map[string]int{}
	for _, g := range gpus {
		count[g.Name]++
	}
	best := gpus[0]
	for _, g := range gpus {
		if count[g.Name] > count[best.Name] {
			best = g
		}
	}
	return best
}

// sharingOf is the config's sharing strategy and its largest replica count.
func sharingOf(cfg config.Selected) (string, int) {
	if cfg.Config == nil {
		return "none", 1
	}
	sh := cfg.Config.Sharing
	replicas := 1
	strategy := "none"
	if sh.TimeSlicing != nil {
		for _, r := range sh.TimeSlicing.Resources {
			if r.Replicas > 1 {
				strategy = "time-slicing"
				replicas = max(replicas, r.Replicas)
			}
		}
	}
	if sh.MPS != nil {
		for _, r := range sh.MPS.Resources {
			if r.Replicas > 1 {
				strategy = "mps"
				replicas = max(replicas, r.Replicas)
			}
		}
	}
	return strategy, replicas
}

// renamed reports whether every shared resource is offered under another
// name: GFD then keeps the product label as it is.
func renamed(cfg config.Selected) bool {
	if cfg.Config == nil {
		return false
	}
	var all []config.ReplicatedResource
	if ts := cfg.Config.Sharing.TimeSlicing; ts != nil {
		all = append(all, ts.Resources...)
	}
	if m := cfg.Config.Sharing.MPS; m != nil {
		for _, r := range m.Resources {
			all = append(all, r.ReplicatedResource)
		}
	}
	return len(all) > 0 && !slices.ContainsFunc(all, func(r config.ReplicatedResource) bool { return r.Rename == "" })
}

// sliceCount reads the GPU-instance slice count from a profile name ("3g.40gb" → 3).
func sliceCount(profile string) int {
	p := profile
	if _, rest, ok := strings.Cut(profile, "c."); ok && strings.Contains(rest, "g.") {
		p = rest // "1c.3g.40gb": compute slices of a 3g instance
	}
	g, _, ok := strings.Cut(p, "g.")
	if !ok {
		return 0
	}
	n, err := strconv.Atoi(g)
	if err != nil {
		return 0
	}
	return n
}

func isDigits(s string) bool {
	return s != "" && strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' }) < 0
}

// labelValue makes s a valid label value: at most 63 characters of
// [A-Za-z0-9._-], starting and ending with an alphanumeric.
func labelValue(s string) string {
	b := []byte(s)
	for i, c := range b {
		ok := c == '.' || c == '_' || c == '-' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
		if !ok {
			b[i] = '-'
		}
	}
	out := string(b)
	if len(out) > 63 {
		out = out[:63]
	}
	return strings.Trim(out, "-._")
}

// labelDiff lists the label keys whose values differ, for logs.
func labelDiff(a, b map[string]string) string {
	var out []string
	for _, k := range slices.Sorted(maps.Keys(b)) {
		if a[k] != b[k] {
			out = append(out, fmt.Sprintf("%s=%s", k, b[k]))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(a)) {
		if _, ok := b[k]; !ok {
			out = append(out, k+"-")
		}
	}
	return strings.Join(out, " ")
}
