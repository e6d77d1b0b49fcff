package config

import (
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Validate checks f without the hardware and returns warnings and an
// ErrorList (or nil). Parse calls it after applying defaults; it is exported
// for Files built or changed in code. Empty enum fields are accepted as
// "the default", so it also works on a File that has not been defaulted.
//
// Not checked here, because they need the node's GPUs (done by the planners
// on the Selected config): that a MIG profile exists on the GPU model, that
// layout indices and sharing device references name existing devices (and
// whether an index and a UUID name the same device), placement feasibility,
// and MPS limits that depend on the compute capability.
func (f *File) Validate() ([]string, error) {
	v := newValidator(f, checkAll)
	v.file()
	return v.warnings, v.errs.err()
}

// checks selects what a validator looks at. A ConfigMap key is checked on
// its own (checkLocal), then its references against the whole map
// (checkRefs), then the map once as a whole (checkWhole), so that a name
// defined by another key is not an error and nothing is reported twice.
type checks int

const (
	// checkLocal is everything that needs nothing outside the file.
	checkLocal checks = 1 << iota
	// checkRefs is each name the file uses that another key may define:
	// nodes: entries' configs, migPartedConfig's mig-configs entry and its
	// layout against the config's MIG strategy. Names are looked up in
	// validator.configs and validator.migs.
	checkRefs
	// checkWhole is about the whole set of configs: at least one, and
	// which a node without an entry or label gets.
	checkWhole

	checkAll = checkLocal | checkRefs | checkWhole
)

type validator struct {
	f    *File
	what checks
	// configs and migs are where referenced names are looked up: the
	// file's own, or those of the whole ConfigMap.
	configs  map[string]*Config
	migs     map[string]MigLayout
	errs     ErrorList
	warnings []string
}

func newValidator(f *File, what checks) *validator {
	return &validator{f: f, what: what, configs: f.Configs, migs: f.MigConfigs}
}

// errorf records an error at a path of the converted File, reported at the
// path and line the user wrote.
func (v *validator) errorf(path, format string, args ...any) {
	p := v.f.originalPath(path)
	v.errs = append(v.errs, &FieldError{Path: p, Line: v.f.lineOf(p), Msg: fmt.Sprintf(format, args...)})
}

func (v *validator) warnf(path, format string, args ...any) {
	p := v.f.originalPath(path)
	w := &FieldError{Path: p, Line: v.f.lineOf(p), Msg: fmt.Sprintf(format, args...)}
	v.warnings = append(v.warnings, w.Error())
}

func (v *validator) file() {
	f := v.f
	local, refs := v.what&checkLocal != 0, v.what&checkRefs != 0
	if local {
		switch f.Version {
		case Version:
		case "":
			v.errorf("version", "required; must be %s", Version)
		default:
			v.errorf("version", "unsupported version %q; must be %s", f.Version, Version)
		}
		if f.Format == FormatMigParted && len(f.MigConfigs) == 0 {
			v.errorf("mig-configs", "at least one entry is required")
		}
	}

	if v.what&checkWhole != 0 {
		if len(f.Configs) == 0 {
			if f.Format != FormatMigParted { // reported above, in its own terms
				v.errorf("configs", "at least one config is required")
			}
		} else if _, ok := f.Configs[DefaultConfigName]; !ok && f.DefaultKey == "" {
			v.warnf("configs", "no %q config: a node without a nodes: entry or a %s or %s label gets the implicit default (whole GPUs, existing MIG devices)",
				DefaultConfigName, ConfigLabel, DevicePluginConfigLabel)
		}
	}

	for _, node := range sortedKeys(f.Nodes) {
		name := f.Nodes[node]
		p := joinKey("nodes", node)
		switch _, ok := v.configs[name]; {
		case node == "":
			if local {
				v.errorf(p, "empty node name")
			}
		case name == "":
			if local {
				v.errorf(p, "empty config name")
			}
		case !ok && refs:
			v.errorf(p, "config %q is not defined under configs", name)
		}
	}

	if local {
		for _, name := range sortedKeys(f.MigConfigs) {
			p := joinKey("mig-configs", name)
			if len(f.MigConfigs[name]) == 0 {
				v.errorf(p, "at least one entry is required")
				continue
			}
			v.layout(p, f.MigConfigs[name])
		}
	}

	for _, name := range sortedKeys(f.Configs) {
		p := joinKey("configs", name)
		if local && !isLabelValue(name) {
			v.warnf(p, "config name is not a valid label value, so the %s label cannot select it", ConfigLabel)
		}
		c := f.Configs[name]
		if c == nil {
			continue // an empty entry: every field takes its default
		}
		v.config(p, c)
	}
}

func (v *validator) config(p string, c *Config) {
	if v.what&checkLocal != 0 {
		for _, s := range c.DevicePlugin.ListStrategies() {
			if !slices.Contains(DeviceListStrategies, s) {
				v.errorf(p+".devicePlugin.deviceListStrategy", "unknown strategy %q: must be one or more of %s", s, strings.Join(DeviceListStrategies, ", "))
			}
		}
		if pre := c.DevicePlugin.CDIAnnotationPrefix; pre != "" {
			if err := checkAnnotationPrefix(pre); err != "" {
				v.errorf(p+".devicePlugin.cdiAnnotationPrefix", "%q: %s", pre, err)
			}
		}
		switch s := c.DevicePlugin.DeviceIDStrategy; s {
		case "", DeviceIDStrategyUUID, DeviceIDStrategyIndex:
		default:
			v.errorf(p+".devicePlugin.deviceIDStrategy", "unknown value %q: must be %s or %s", s, DeviceIDStrategyUUID, DeviceIDStrategyIndex)
		}
		switch c.Allocation.Policy {
		case "", PolicyTopology, PolicyPacked, PolicyDistributed:
		default:
			v.errorf(p+".allocation.policy", "unknown policy %q: must be topology, packed or distributed", c.Allocation.Policy)
		}
		switch c.MIG.Strategy {
		case "", MIGStrategyNone, MIGStrategySingle, MIGStrategyMixed:
		default:
			v.errorf(p+".mig.strategy", "unknown strategy %q: must be none, single or mixed", c.MIG.Strategy)
		}
		v.sharing(p+".sharing", &c.Sharing, c.MIG.Strategy)
		v.health(p+".health", &c.Health)
		v.dra(p+".dra", &c.DRA)
		switch d := c.Usage.IdleEventAfter; {
		case d < 0:
			v.errorf(p+".usage.idleEventAfter", "%s: must not be negative (leave it out to send no Events)", d.D())
		case d != 0 && d.D() < MinIdleEventAfter:
			v.errorf(p+".usage.idleEventAfter", "%s is shorter than %s: idle time is measured every 10 s, so give it in minutes or hours (such as \"2h\"), or leave it out to send no Events",
				d.D(), MinIdleEventAfter)
		}
	}
	v.mig(p+".mig", &c.MIG)
}

// mig checks a config's MIG part. A layout given inline is checked with
// the file (checkLocal); one named by migPartedConfig may be another key's,
// so it is checked with the references (checkRefs).
func (v *validator) mig(p string, m *MIG) {
	local, refs := v.what&checkLocal != 0, v.what&checkRefs != 0
	if local {
		switch m.ResetPolicy {
		case "", ResetWhenIdle, ResetNever:
		default:
			v.errorf(p+".resetPolicy", "unknown policy %q: must be %s or %s", m.ResetPolicy, ResetWhenIdle, ResetNever)
		}
	}
	layout, layoutPath := m.Devices, p+".devices"
	switch {
	case m.Devices != nil && m.MigPartedConfig != "":
		if local {
			v.errorf(p+".migPartedConfig", "set together with mig.devices; use one of them")
		}
		return
	case m.Devices != nil:
		if !local {
			return
		}
		if len(m.Devices) == 0 {
			v.errorf(layoutPath, "empty layout; omit mig.devices to leave MIG alone")
			return
		}
		v.layout(layoutPath, m.Devices)
	case m.MigPartedConfig != "":
		if !refs {
			return
		}
		l, ok := v.migs[m.MigPartedConfig]
		if !ok {
			v.errorf(p+".migPartedConfig", "%q is not defined under mig-configs", m.MigPartedConfig)
			return
		}
		// The entry itself is validated once, under mig-configs; a problem
		// of the pair is reported there when this file has the entry, else
		// at the reference.
		layout, layoutPath = l, joinKey("mig-configs", m.MigPartedConfig)
		if _, own := v.f.MigConfigs[m.MigPartedConfig]; !own {
			layoutPath = p + ".migPartedConfig"
		}
	default:
		return
	}
	enabled := false
	profiles := map[string]bool{}
	for _, e := range layout {
		enabled = enabled || e.MigEnabled
		for prof, n := range e.MigDevices {
			if n > 0 {
				profiles[prof] = true
			}
		}
	}
	switch {
	case v.f.Format == FormatMigParted:
		// The strategy of a config made from a mig-parted entry is the
		// agent's --mig-strategy, not the file's: like NVIDIA's plugin,
		// report a layout it cannot serve on the node that selects it, not
		// as an error in every entry of a shared file.
	case enabled && (m.Strategy == "" || m.Strategy == MIGStrategyNone):
		v.errorf(p+".strategy", "is none, which exposes no MIG devices, but the layout enables MIG; use single or mixed")
	case m.Strategy == MIGStrategySingle && len(profiles) > 1:
		v.errorf(layoutPath, "strategy single needs one MIG profile on every GPU, the layout has %s",
			strings.Join(sortedKeys(profiles), ", "))
	}
}

var reDeviceFilter = regexp.MustCompile(`^0x[0-9A-Fa-f]{8}$`)

// layout checks a mig-parted layout's syntax; whether the GPUs and profiles
// exist is for the planner.
func (v *validator) layout(p string, l MigLayout) {
	// The first entry to claim a GPU index under a device filter: a later
	// one is reported against it alone, so n entries for one GPU make n-1
	// errors rather than n²/2.
	type claim struct {
		idx    int
		filter string
	}
	claimed := map[claim]int{}
	for i, e := range l {
		ep := joinIndex(p, i)
		for j, df := range e.DeviceFilter {
			if !reDeviceFilter.MatchString(df) {
				fp := ep + ".device-filter"
				if len(e.DeviceFilter) > 1 {
					fp = joinIndex(fp, j)
				}
				v.errorf(fp, "%q is not a PCI device id like 0x20B010DE", df)
			}
		}
		filter := strings.ToLower(strings.Join(slices.Sorted(slices.Values(e.DeviceFilter)), ","))
		switch {
		case e.Devices.IsZero():
			v.errorf(ep+".devices", "required: \"all\" or a list of GPU indices")
		case !e.Devices.All && len(e.Devices.Indices) == 0:
			v.errorf(ep+".devices", "empty list of GPU indices")
		case !e.Devices.All:
			seen := map[int]bool{}
			for j, idx := range e.Devices.Indices {
				ip := joinIndex(ep+".devices", j)
				if idx < 0 {
					v.errorf(ip, "negative GPU index %d", idx)
					continue
				}
				if seen[idx] {
					v.errorf(ip, "GPU %d listed twice", idx)
					continue
				}
				seen[idx] = true
				// With the same device filter, the same index in two entries
				// is two layouts for one GPU.
				if first, ok := claimed[claim{idx, filter}]; ok {
					v.errorf(ip, "GPU %d is already configured by entry [%d]", idx, first)
				} else {
					claimed[claim{idx, filter}] = i
				}
			}
		}
		switch {
		case e.MigEnabled && e.MigDevices == nil:
			v.errorf(ep+".mig-devices", "required when mig-enabled is true (use {} for MIG mode without instances)")
		case !e.MigEnabled && len(e.MigDevices) > 0:
			v.errorf(ep+".mig-devices", "set but mig-enabled is false")
		}
		for _, prof := range sortedKeys(e.MigDevices) {
			pp := joinKey(ep+".mig-devices", prof)
			if err := checkProfile(prof); err != nil {
				v.errorf(pp, "%v", err)
			}
			if n := e.MigDevices[prof]; n <= 0 {
				v.errorf(pp, "count must be > 0, got %d", n)
			}
		}
	}
}

// reProfile is a MIG profile name as NVML and mig-parted write it:
// [<c>c.]<g>g.<mem>gb, optionally with attributes (+me, +gfx, +me.all) or
// the -me suffix of profiles without media engines.
var reProfile = regexp.MustCompile(`^(?:([0-9]+)c\.)?([0-9]+)g\.([0-9]+)gb(?:\+[a-z][a-z0-9]*(?:\.[a-z0-9]+)*(?:,[a-z][a-z0-9]*(?:\.[a-z0-9]+)*)*)?(?:-me)?$`)

// checkProfile checks the form of a MIG profile name; whether this GPU model
// has it is checked against NVML later.
func checkProfile(s string) error {
	m := reProfile.FindStringSubmatch(s)
	if m == nil {
		return fmt.Errorf("%q is not a MIG profile like 1g.10gb, 1c.2g.20gb or 1g.10gb+me", s)
	}
	g, _ := strconv.Atoi(m[2])
	mem, _ := strconv.Atoi(m[3])
	if g < 1 || g > 8 || mem < 1 {
		return fmt.Errorf("%q: slice and memory counts must be positive (at most 8 slices)", s)
	}
	if m[1] != "" {
		c, _ := strconv.Atoi(m[1])
		if c < 1 || c > g {
			return fmt.Errorf("%q: compute slices must be between 1 and the %d GPU slices", s, g)
		}
	}
	return nil
}

// SpareLayoutSlices reports whether key, of migOnDemand.spareLayout, names
// a profile by its compute slices alone ("1g" to "8g": each model's plain
// profile of that many with the least memory), and how many.
func SpareLayoutSlices(key string) (int, bool) {
	if len(key) != 2 || key[1] != 'g' || key[0] < '1' || key[0] > '8' {
		return 0, false
	}
	return int(key[0] - '0'), true
}

// dra checks what the DRA driver is asked to publish.
func (v *validator) dra(p string, d *DRA) {
	v.migDeviceAttributes(p+".migDeviceAttributes", d.MIGDeviceAttributes)
	od := d.MIGOnDemand
	if od == nil {
		return
	}
	seen := map[string]bool{}
	for i, prof := range od.Profiles {
		if err := checkProfile(prof); err != nil {
			v.errorf(fmt.Sprintf("%s.migOnDemand.profiles[%d]", p, i), "%v", err)
		} else if seen[prof] {
			v.errorf(fmt.Sprintf("%s.migOnDemand.profiles[%d]", p, i), "%q is listed twice", prof)
		}
		seen[prof] = true
	}
	for i, id := range od.DeviceFilter {
		if !reDeviceFilter.MatchString(id) {
			v.errorf(fmt.Sprintf("%s.migOnDemand.device-filter[%d]", p, i), "%q is not a PCI device id like 0x233010DE", id)
		}
	}
	if od.SpareGPUs < 0 {
		v.errorf(p+".migOnDemand.spareGPUs", "must be 0 (every GPU offers MIG devices on demand) or more, got %d", od.SpareGPUs)
	}
	for _, prof := range sortedKeys(od.SpareLayout) {
		f := joinKey(p+".migOnDemand.spareLayout", prof)
		_, short := SpareLayoutSlices(prof)
		switch n := od.SpareLayout[prof]; {
		case !short && checkProfile(prof) != nil:
			v.errorf(f, "%v (or compute slices alone, like 1g, for the smallest such profile of each model)", checkProfile(prof))
		case n < 1 || n > 8:
			v.errorf(f, "count must be 1 to 8, got %d", n)
		case !short && len(od.Profiles) > 0 && !seen[prof]:
			v.errorf(f, "%q is not among migOnDemand.profiles %v, the only profiles offered", prof, []string(od.Profiles))
		}
	}
	if od.SpareLayout != nil && od.SpareGPUs < 1 {
		v.errorf(p+".migOnDemand.spareLayout", "needs spareGPUs of 1 or more: it is what each spare GPU offers")
	}
	if od.SpareLayout != nil && len(od.SpareLayout) == 0 {
		v.errorf(p+".migOnDemand.spareLayout", "lists no profile: a spare would offer nothing")
	}
	if !od.Enabled && (len(od.Profiles) > 0 || len(od.DeviceFilter) > 0 || od.SpareGPUs > 0 || od.SpareLayout != nil) {
		v.warnf(p+".migOnDemand", "profiles, device-filter, spareGPUs or spareLayout given but enabled is false: no MIG device is offered on demand")
	}
}

// migDeviceAttributes checks the attributes MIG devices are to keep.
func (v *validator) migDeviceAttributes(p string, names []string) {
	if names == nil {
		return
	}
	if len(names) == 0 {
		v.errorf(p, "lists no attribute: name those to keep beside type and profile, or leave it out to keep all")
		return
	}
	seen := map[string]bool{}
	kept := len(MIGAttributesAlways)
	for i, name := range names {
		f := fmt.Sprintf("%s[%d]", p, i)
		switch {
		case slices.Contains(MIGAttributesAlways, name):
			v.warnf(f, "%q is always published on MIG devices: listing it changes nothing", name)
		case !slices.Contains(MIGAttributesOptional, name):
			v.errorf(f, "%q is not an attribute of a MIG device; one of %s", name, strings.Join(MIGAttributesOptional, ", "))
		case seen[name]:
			v.errorf(f, "%q is listed twice", name)
		default:
			kept++
		}
		seen[name] = true
	}
	if kept > MIGAttributesInSmallMap {
		v.warnf(p, "%d attributes per MIG device (with type and profile): above %d the scheduler's decoded map of each doubles, so this saves little of what leaving attributes out is for", kept, MIGAttributesInSmallMap)
	}
}

// sharing checks both policies, then that no device is in both.
func (v *validator) sharing(p string, s *Sharing, strategy MIGStrategy) {
	var ts, mps []ReplicatedResource
	if s.TimeSlicing != nil {
		ts = s.TimeSlicing.Resources
		v.replicated(p+".timeSlicing", ts, strategy)
	}
	if s.MPS != nil {
		for _, r := range s.MPS.Resources {
			mps = append(mps, r.ReplicatedResource)
		}
		v.replicated(p+".mps", mps, strategy)
		for i, r := range s.MPS.Resources {
			rp := joinIndex(p+".mps.resources", i)
			if a := r.ActiveThreadPercentage; a != nil && (*a < 1 || *a > 100) {
				v.errorf(rp+".activeThreadPercentage", "must be between 1 and 100, got %d", *a)
			}
			if q := r.PinnedDeviceMemoryLimit; q != nil && *q <= 0 {
				v.errorf(rp+".pinnedDeviceMemoryLimit", "must be > 0")
			}
		}
	}
	// Only the first time-slicing entry of a name is compared: a second one
	// is an error of its own, and comparing every pair would let a list of
	// aliases produce errors by the square of its length.
	tsByName := map[string]int{}
	for i, t := range ts {
		if _, ok := tsByName[t.Name]; !ok {
			tsByName[t.Name] = i
		}
	}
	tsLists := map[int]map[string]bool{}
	for j, m := range mps {
		i, ok := tsByName[m.Name]
		if !ok {
			continue
		}
		t := ts[i]
		if t.Devices.List != nil && tsLists[i] == nil {
			tsLists[i] = map[string]bool{}
			for _, ref := range t.Devices.List {
				tsLists[i][ref] = true
			}
		}
		if devicesOverlap(tsLists[i], m.Devices) {
			v.errorf(joinIndex(p+".mps.resources", j)+".devices",
				"%s devices are also shared by %s; a device can be in one sharing policy only",
				m.Name, v.f.originalPath(joinIndex(p+".timeSlicing.resources", i)))
		}
	}
	// Two resources advertised under one name would merge into one device
	// plugin server with mixed semantics.
	advertised := map[string]string{}
	check := func(rp string, r ReplicatedResource) {
		name := r.Rename
		if name == "" {
			name = r.Name
		}
		if name == "" {
			return
		}
		if prev, ok := advertised[name]; ok {
			v.errorf(rp, "%s is already advertised by %s", name, v.f.originalPath(prev))
			return
		}
		advertised[name] = rp
	}
	for i, r := range ts {
		check(joinIndex(p+".timeSlicing.resources", i), r)
	}
	for i, r := range mps {
		check(joinIndex(p+".mps.resources", i), r)
	}
}

func (v *validator) replicated(p string, rs []ReplicatedResource, strategy MIGStrategy) {
	if len(rs) == 0 {
		v.errorf(p+".resources", "at least one resource is required")
		return
	}
	names := map[string]int{}
	for i, r := range rs {
		rp := joinIndex(p+".resources", i)
		switch {
		case r.Name == "":
			v.errorf(rp+".name", "required: nvidia.com/gpu or nvidia.com/mig-<profile>")
		case !isSharableName(r.Name):
			v.errorf(rp+".name", "%q: must be nvidia.com/gpu or nvidia.com/mig-<profile>", r.Name)
		default:
			if first, dup := names[r.Name]; dup {
				v.errorf(rp+".name", "%s is already listed at resources[%d]", r.Name, first)
			} else {
				names[r.Name] = i
			}
			if strings.HasPrefix(r.Name, "nvidia.com/mig-") && strategy != MIGStrategyMixed {
				v.warnf(rp+".name", "%s exists only with mig.strategy mixed", r.Name)
			}
		}
		if r.Rename != "" {
			if err := checkExtendedResourceName(r.Rename); err != nil {
				v.errorf(rp+".rename", "%v", err)
			}
		}
		switch {
		case r.Replicas == 0:
			v.errorf(rp+".replicas", "required; must be >= 2")
		case r.Replicas < 2:
			v.errorf(rp+".replicas", "must be >= 2, got %d", r.Replicas)
		case r.Replicas > MaxReplicas:
			v.errorf(rp+".replicas", "%d exceeds the maximum of %d", r.Replicas, MaxReplicas)
		}
		d := r.Devices
		switch {
		case d.Count < 0:
			v.errorf(rp+".devices", "count must be > 0, got %d", d.Count)
		case d.List != nil && len(d.List) == 0:
			v.errorf(rp+".devices", "empty device list; omit devices for all")
		case d.List != nil:
			seen := map[string]bool{}
			for j, ref := range d.List {
				dp := joinIndex(rp+".devices", j)
				if !IsDeviceRef(ref) {
					v.errorf(dp, "%q is not a GPU index, a \"gpu:mig\" index or a GPU/MIG UUID", ref)
				} else if seen[ref] {
					v.errorf(dp, "%q listed twice", ref)
				}
				seen[ref] = true
			}
		}
	}
}

// devicesOverlap reports whether two selections of the same resource may
// share a device; a is the first's list as a set, nil unless it is a list.
// Only literal list entries can be compared here; an index in one list and
// the UUID of the same GPU in the other is found when the selections are
// resolved against the hardware.
func devicesOverlap(a map[string]bool, b ReplicaDevices) bool {
	if a == nil || b.List == nil {
		return true // all, or the first N devices, which include any device of the other
	}
	for _, x := range b.List {
		if a[x] {
			return true
		}
	}
	return false
}

func (v *validator) health(p string, h *Health) {
	ignored := map[int]bool{}
	for i, x := range h.IgnoredXids {
		if x <= 0 {
			v.errorf(joinIndex(p+".ignoredXids", i), "XID must be > 0, got %d", x)
		}
		ignored[x] = true
	}
	for i, x := range h.FatalXids {
		switch {
		case x <= 0:
			v.errorf(joinIndex(p+".fatalXids", i), "XID must be > 0, got %d", x)
		case ignored[x]:
			v.errorf(joinIndex(p+".fatalXids", i), "XID %d is also in ignoredXids", x)
		}
	}
	if h.RecoveryQuietPeriod < 0 {
		v.errorf(p+".recoveryQuietPeriod", "must be > 0, got %s", h.RecoveryQuietPeriod.D())
	}
	if h.ProbeInterval < 0 {
		v.errorf(p+".probeInterval", "must be > 0, got %s", h.ProbeInterval.D())
	}
	switch h.DRATaintEffect {
	case "", DRATaintNoSchedule, DRATaintNoExecute:
	default:
		v.errorf(p+".draTaintEffect", "unknown value %q: must be %s or %s", h.DRATaintEffect, DRATaintNoSchedule, DRATaintNoExecute)
	}
}

var (
	reMIGResource = regexp.MustCompile(`^nvidia\.com/mig-([0-9]+c\.)?[1-9][0-9]*g\.[1-9][0-9]*gb([.-][a-z][a-z0-9]*)*$`)
	reDNSLabel    = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	reQualName    = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
	reLabelValue  = regexp.MustCompile(`^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$`)
)

// isSharableName reports whether a resource can be replicated: whole GPUs
// or a MIG profile's resource, under NVIDIA's names.
func isSharableName(s string) bool {
	return s == "nvidia.com/gpu" || (reMIGResource.MatchString(s) && checkExtendedResourceName(s) == nil)
}

// checkExtendedResourceName applies the Kubernetes rules for an extended
// resource name: <domain>/<name>, the domain a DNS subdomain outside
// kubernetes.io, the name a qualified-name segment of at most 63 characters.
func checkExtendedResourceName(s string) error {
	domain, name, ok := strings.Cut(s, "/")
	if !ok || strings.Contains(name, "/") {
		return fmt.Errorf("%q: must be <domain>/<name>, e.g. nvidia.com/gpu.shared", s)
	}
	if len(domain) > 253 || domain == "" {
		return fmt.Errorf("%q: domain must be 1 to 253 characters", s)
	}
	for _, label := range strings.Split(domain, ".") {
		if len(label) > 63 || !reDNSLabel.MatchString(label) {
			return fmt.Errorf("%q: domain %q is not a DNS subdomain (lower case letters, digits, '-', '.')", s, domain)
		}
	}
	if domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io") || strings.HasPrefix(domain, "requests.") {
		return fmt.Errorf("%q: domain %q is reserved by Kubernetes", s, domain)
	}
	if len(name) > 63 || !reQualName.MatchString(name) {
		return fmt.Errorf("%q: name %q must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit", s, name)
	}
	return nil
}

func isLabelValue(s string) bool { return len(s) <= 63 && reLabelValue.MatchString(s) }

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// checkAnnotationPrefix checks that prefix starts valid annotation keys: a
// DNS subdomain and a slash, as in "cdi.k8s.io/" ("" when it does).
func checkAnnotationPrefix(prefix string) string {
	dom, ok := strings.CutSuffix(prefix, "/")
	if !ok {
		return `must end with "/"`
	}
	if errs := validation.IsDNS1123Subdomain(dom); len(errs) > 0 {
		return "not a DNS subdomain followed by \"/\": " + strings.Join(errs, "; ")
	}
	return ""
}
