package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// defaultOfflineBackend is the node the offline tools (config validate, mig
// plan, inventory) look at when neither --backend nor --addr says: the one
// `make run` simulates, so that a config checked on a laptop is checked
// against the node the Quick start runs.
const defaultOfflineBackend = "sim:dgx-a100"

// nodeFlags say which node an offline tool looks at. The tools never change
// it: a simulated node is read as a copy (a state file another process
// holds included), and a layout is tried on a copy of that copy.
type nodeFlags struct {
	backend, addr, nvmlLib string
}

func (n *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&n.backend, "backend", envDefault("GPU_AGENT_BACKEND", defaultOfflineBackend),
		"the node to look at: sim:<profile>[,state=FILE] (a copy; 'gpu-agent sim list') or nvml, this machine's GPUs [GPU_AGENT_BACKEND]")
	fs.StringVar(&n.addr, "addr", "",
		"a running agent's HTTP address: look at a copy of its simulated node (GET /sim/state) instead of --backend")
	fs.StringVar(&n.nvmlLib, "nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
}

// open opens the node to look at; fs tells whether --backend was given.
func (n *nodeFlags) open(ctx context.Context, fs *flag.FlagSet) (*backend, error) {
	if n.addr == "" {
		return openOfflineBackend(n.backend, n.nvmlLib)
	}
	explicit := false
	fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "backend" })
	if explicit {
		return nil, usageError{"--addr and --backend: give one, the running agent's node or another"}
	}
	state, err := fetchSimState(ctx, n.addr)
	if err != nil {
		return nil, err
	}
	profile, err := sim.StateProfile(state)
	if err != nil {
		return nil, fmt.Errorf("--addr %s: %w", n.addr, err)
	}
	return openSimCopy(fmt.Sprintf("sim:%s at %s", profile, n.addr), profile, sim.WithState(state))
}

// openOfflineBackend is openBackend for the offline tools: a simulated
// node's state file is read, not locked, so the tools can look at the node
// an agent is running on it (make run's .run/sim-state.json).
func openOfflineBackend(spec, nvmlLib string) (*backend, error) {
	if !strings.HasPrefix(spec, "sim:") {
		return openBackend(spec, nvmlLib, nil)
	}
	ss, err := parseSimSpec(spec)
	if err != nil {
		return nil, err
	}
	profile, opts := ss.profile, ss.opts
	path := simStatePath(spec)
	if path == "" {
		return openBackend(spec, nvmlLib, nil)
	}
	data, err := atomicfile.ReadFile(path, 1<<20)
	switch {
	case errors.Is(err, os.ErrNotExist):
		// As a new state file starts: from the profile.
		data = nil
	case err != nil:
		return nil, fmt.Errorf("backend %s: state file %s: %w", spec, path, err)
	}
	// The options given, the state file's content in place of the file.
	copyOpts := append(opts, sim.WithStateFile(""))
	if data != nil {
		copyOpts = append(copyOpts, sim.WithState(data))
	}
	return openSimCopy(spec, profile, copyOpts...)
}

// simStatePath is the state= option of a sim backend spec ("" for none).
func simStatePath(spec string) string {
	for opt := range strings.SplitSeq(spec, ",") {
		if p, ok := strings.CutPrefix(opt, "state="); ok {
			return p
		}
	}
	return ""
}

// openSimCopy builds and initialises a simulated node named name.
func openSimCopy(name, profile string, opts ...sim.Option) (*backend, error) {
	node, err := sim.New(profile, opts...)
	if err != nil {
		return nil, fmt.Errorf("backend %s: %w", name, err)
	}
	if ret := node.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("backend %s: init: %v", name, ret)
	}
	return &backend{Name: name, Lib: node, Sim: node, close: func() { node.Shutdown() }}, nil
}

// fetchSimState asks the agent at addr for its simulated node's state.
func fetchSimState(ctx context.Context, addr string) ([]byte, error) {
	url, err := agentURL(addr, "/sim/state")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, usageError{fmt.Sprintf("--addr %q: %v", addr, err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("--addr: cannot reach the agent: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20+1))
	if err != nil {
		return nil, fmt.Errorf("--addr: read %s: %w", url, err)
	}
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, fmt.Errorf("--addr: the agent at %s runs no simulated node (%s: %s); on a GPU node run the tool there with --backend nvml", addr, url, resp.Status)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("--addr: %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	case len(body) > 1<<20:
		return nil, fmt.Errorf("--addr: %s: more than 1 MiB, not a simulated node's state", url)
	}
	return body, nil
}

// agentURL joins an agent's address (with or without a scheme) and a path.
func agentURL(addr, path string) (string, error) {
	if addr == "" {
		return "", usageError{"--addr is empty"}
	}
	base := addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	return strings.TrimRight(base, "/") + path, nil
}

// readConfigArg reads what `config validate` and `mig plan` are given, each
// the way the agent would read it: a directory is a mounted ConfigMap (every
// key a config), a ConfigMap manifest (deploy/examples, kubectl apply -f)
// its data, anything else one config file.
func readConfigArg(path string) (u config.Update, what string, err error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		u.Files, err = config.ReadDir(path)
		return u, "ConfigMap directory", err
	}
	if u.Data, err = config.ReadFile(path); err != nil {
		return u, "", err
	}
	keys, ok, err := config.ConfigMapManifest(u.Data)
	switch {
	case err != nil:
		return u, "", fmt.Errorf("%s: %w", path, err)
	case ok:
		names := make([]string, 0, len(keys))
		for k := range keys {
			names = append(names, k)
		}
		sort.Strings(names)
		return config.Update{Files: keys}, "ConfigMap manifest, keys " + strings.Join(names, ", "), nil
	}
	return u, "", nil
}

// parseLabels reads --labels k=v[,k=v...].
func parseLabels(list string) (map[string]string, error) {
	labels := map[string]string{}
	for kv := range strings.SplitSeq(list, ",") {
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usageError{fmt.Sprintf("--labels %q: want key=value", kv)}
		}
		labels[k] = v
	}
	return labels, nil
}

// selection is what the config tools share: the config file and how the
// node picks its config from it.
type selection struct {
	node, labels, defaultConfig, migStrategy string
	// warnings counts the warnings load printed.
	warnings int
}

func (s *selection) register(fs *flag.FlagSet) {
	host, _ := os.Hostname()
	fs.StringVar(&s.node, "node-name", envDefault("NODE_NAME", host), "node whose config is selected [NODE_NAME]")
	fs.StringVar(&s.labels, "labels", "", "the node's labels, k=v[,k=v...] (gpu-agent.io/config, nvidia.com/device-plugin.config, nvidia.com/mig.config)")
	fs.StringVar(&s.defaultConfig, "default-config", envDefault("GPU_AGENT_DEFAULT_CONFIG", ""), "config for nodes nothing selects [GPU_AGENT_DEFAULT_CONFIG]")
	fs.StringVar(&s.migStrategy, "mig-strategy", envDefault("MIG_STRATEGY", ""), "the agent's --mig-strategy: none, single or mixed [MIG_STRATEGY]")
}

// load reads file and selects the node's config, printing the file's
// warnings to stderr.
func (s *selection) load(file string, stderr io.Writer) (*config.File, config.Selected, string, error) {
	labels, err := parseLabels(s.labels)
	if err != nil {
		return nil, config.Selected{}, "", err
	}
	opts := config.ParseOptions{MIGStrategy: config.MIGStrategy(s.migStrategy)}
	if err := opts.Check(); err != nil {
		return nil, config.Selected{}, "", usageError{"--mig-strategy: " + err.Error()}
	}
	u, what, err := readConfigArg(file)
	if err != nil {
		return nil, config.Selected{}, "", err
	}
	f, warnings, err := u.ParseWith(s.defaultConfig, opts)
	for _, w := range warnings {
		fmt.Fprintf(stderr, "warning: %s: %s\n", file, w)
	}
	s.warnings += len(warnings)
	if err != nil {
		return nil, config.Selected{}, "", fmt.Errorf("%s: invalid:\n%w", file, err)
	}
	sel, err := f.Select(s.node, labels)
	if err != nil {
		// Select's errors name the node already.
		return nil, config.Selected{}, "", fmt.Errorf("%s: %w", file, err)
	}
	return f, sel, what, nil
}

// configFileArg takes the one FILE argument, before or after the flags.
func configFileArg(fs *flag.FlagSet, args []string) (string, error) {
	var file string
	if len(args) > 0 && len(args[0]) > 0 && args[0][0] != '-' {
		file, args = args[0], args[1:]
	}
	if err := parseFlags(fs, args); err != nil {
		return "", err
	}
	switch {
	case file == "" && fs.NArg() == 1:
		return fs.Arg(0), nil
	case file == "" && fs.NArg() == 0:
		return "", usageError{"want exactly one FILE"}
	case fs.NArg() > 0:
		return "", usageError{fmt.Sprintf("want exactly one FILE; unexpected arguments: %s", strings.Join(fs.Args(), " "))}
	}
	return file, nil
}

// subcommand checks that args name the one subcommand sub (config
// validate, mig plan): done when the caller is to return err instead,
// after printing the usage for -h or refusing anything else.
func subcommand(args []string, sub, synopsis string, stdout io.Writer) (done bool, err error) {
	switch {
	case len(args) > 0 && args[0] == sub:
		return false, nil
	case len(args) > 0 && (args[0] == "-h" || args[0] == "--help"):
		fmt.Fprintln(stdout, "Usage: gpu-agent "+synopsis)
		return true, nil
	}
	return true, usageError{"want: " + synopsis}
}

const validateSynopsis = "config validate FILE [--backend sim:<profile>[,state=F]|nvml | --addr URL] [--node-name N] [--labels K=V,...] [--claims F]... [--strict]"

func cmdConfig(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if done, err := subcommand(args, "validate", validateSynopsis, stdout); done {
		return err
	}
	fs := newFlagSet("config validate", validateSynopsis, stderr)
	var nf nodeFlags
	nf.register(fs)
	var s selection
	s.register(fs)
	strict := fs.Bool("strict", false, "warnings fail too (exit 1), for CI: a field NVIDIA's format ignores, a mig-configs entry that fits no model of the node, a claim that cannot be evaluated, ...")
	var claims claimFiles
	fs.Var(&claims, "claims", "DeviceClasses, ResourceClaims and ResourceClaimTemplates (YAML or JSON, kubectl's List too; - for standard input; again for more files): allocate each claim alone on the node as it would offer, with the kube-scheduler's allocator")
	file, err := configFileArg(fs, args[1:])
	if err != nil {
		return err
	}
	var objs *schedsim.Objects
	if len(claims) > 0 {
		o, err := readClaimFiles(claims, os.Stdin)
		if err != nil {
			return err
		}
		objs = &o
	}
	if err := validate(ctx, file, &nf, &s, fs, objs, stdout, stderr); err != nil {
		return err
	}
	if *strict && s.warnings > 0 {
		return fmt.Errorf("%s: %d %s, and --strict makes them errors", file, s.warnings, plural(s.warnings, "warning", "warnings"))
	}
	return nil
}

func plural(n int, one, more string) string {
	if n == 1 {
		return one
	}
	return more
}

// validate is config validate, warnings counted in s; with claims, each is
// allocated on the node as the config would have it.
func validate(ctx context.Context, file string, nf *nodeFlags, s *selection, fs *flag.FlagSet, claims *schedsim.Objects, stdout, stderr io.Writer) error {
	f, sel, what, err := s.load(file, stderr)
	if err != nil {
		return err
	}
	be, err := nf.open(ctx, fs)
	if err != nil {
		return err
	}
	defer be.Close()
	snap, err := offlineSnapshot(be, sel)
	if err != nil {
		return err
	}
	d := agent.Plan(snap)
	if d.FitErr != nil && !errors.Is(d.FitErr, mig.ErrLayout) {
		return fmt.Errorf("%s: does not fit %s: %w", file, be.Name, d.FitErr)
	}
	for _, w := range d.Warnings {
		fmt.Fprintf(stderr, "warning: %s: on %s: %s\n", file, be.Name, w)
	}
	s.warnings += len(d.Warnings)
	cat, pool := d.Catalog, d.DRA
	offers := fmt.Sprintf("On %s it would offer:\n", be.Name)
	if sel.MIGLayout != nil {
		if err := printMIG(stdout, fmt.Sprintf("MIG layout on %s:\n", be.Name), snap, d, false); err != nil {
			return fmt.Errorf("%s: on %s: %w", file, be.Name, err)
		}
	}
	if len(f.MigConfigs) > 0 {
		reports, err := checkMigConfigs(f, s, snap)
		if err != nil {
			return fmt.Errorf("%s: %w", file, err)
		}
		writeMigConfigs(stdout, be.Name, reports)
		if w := migConfigsWarning(reports, len(nodeModels(snap.Inventory))); w != "" {
			fmt.Fprintf(stderr, "warning: %s: on %s: %s\n", file, be.Name, w)
			s.warnings++
		}
		var errs []string
		for _, rep := range reports {
			if rep.severity == entryIsError {
				errs = append(errs, rep.err.Error())
			}
		}
		if len(errs) > 0 {
			return fmt.Errorf("%s: on %s: %s", file, be.Name, strings.Join(errs, "\n"))
		}
	}
	format := string(f.Format)
	if what != "" {
		format += "; " + what
	}
	fmt.Fprintf(stdout, "%s: valid (%s); node %s uses config %q (by %s)\n", file, format, s.node, sel.Name, sel.Reason)
	if sel.MIGLayout != nil {
		if be.Sim == nil {
			offers = fmt.Sprintf("On %s it offers now (a real node is not repartitioned offline; the layout would change this):\n", be.Name)
		} else {
			after, err := simulateLayout(ctx, be, sel, d)
			if err != nil {
				return fmt.Errorf("%s: %w", file, err)
			}
			cat, pool = after.Catalog, after.DRA
			offers = fmt.Sprintf("On %s, once the layout is applied, it would offer:\n", be.Name)
		}
	}
	fmt.Fprint(stdout, offers)
	if err := writeCatalog(stdout, cat); err != nil {
		return err
	}
	if err := writeDRAFootprint(stdout, pool); err != nil {
		return err
	}
	if claims != nil {
		where := "the node as the config would publish it"
		if sel.MIGLayout != nil && be.Sim == nil {
			where = "the node's devices as they are now, not as the MIG layout would make them (--backend sim:PROFILE tries it)"
		}
		s.warnings += writeClaims(stdout, stderr, file, be.Name, where, *claims, checkClaims(ctx, s.node, pool, *claims))
	}
	return nil
}

// writeDRAFootprint says what the node's ResourceSlices would hold with the
// DRA driver on: their cost is paid by the scheduler for every node at each
// scheduling attempt, so a config's author sees it before a fleet does.
func writeDRAFootprint(w io.Writer, pool *devicemodel.Pool) error {
	f, err := devicemodel.FootprintOf("node", pool)
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "With --dra its ResourceSlices would hold %d devices", f.Devices)
	if f.Partitions > 0 {
		fmt.Fprintf(w, " (%d of them MIG devices made on demand)", f.Partitions)
	}
	if f.CounterSets > 0 {
		fmt.Fprintf(w, " drawing %d times on %d counter sets of %d counters in all", f.Consumptions, f.CounterSets, f.Counters)
	} else {
		fmt.Fprint(w, " and no counters")
	}
	fmt.Fprintf(w, ", in %d slices of %.1f KiB\n", f.Slices, float64(f.Bytes)/1024)
	if f.CounterSets > 0 {
		fmt.Fprintln(w, "  (every node publishing counters costs the scheduler at every attempt on every node: docs/dra-devices.md, \"Scale\")")
	}
	if f.MIG > manyMIGDevices && pool.MIGAttributes == nil {
		fmt.Fprintf(w, "  (%d MIG devices with NVIDIA's attributes, each about 4.4 KB of every scheduler's memory; for a fleet whose claims select MIG devices by a few attributes, dra.migDeviceAttributes keeping at most 6 beside type and profile takes each to about 2.6 KB: docs/dra-devices.md, \"Attributes\"; --claims checks a fleet's claims against it)\n", f.MIG)
	}
	return nil
}

// manyMIGDevices is the most MIG devices a node publishes before config
// validate points to dra.migDeviceAttributes: as many as whole GPUs on an
// 8-GPU node cost the scheduler about what those do.
const manyMIGDevices = 8

func writeCatalog(w io.Writer, cat *catalog.Catalog) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RESOURCE\tDEVICES\tIDS")
	for _, name := range cat.Names() {
		r := cat.Resources[name]
		ids := ""
		for i, d := range r.Devices {
			if i == 3 && len(r.Devices) > 4 {
				ids += fmt.Sprintf(", ... (%d more)", len(r.Devices)-3)
				break
			}
			if i > 0 {
				ids += ", "
			}
			ids += d.ID
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", name, len(r.Devices), ids)
	}
	return tw.Flush()
}

// simulateLayout applies d's MIG plans to a copy of be's simulated node, as
// the agent would on an idle node whose GPUs take MIG mode changes without
// waiting for a reset, and returns what the copy then plans. be itself, and
// the state file of a node an agent runs, are left as they were.
func simulateLayout(ctx context.Context, be *backend, sel config.Selected, d agent.Desired) (agent.Desired, error) {
	state, err := be.Sim.State()
	if err != nil {
		return agent.Desired{}, err
	}
	cp, err := openSimCopy(be.Name+" (copy)", be.Sim.Profile(), sim.WithState(state), sim.WithImmediateMIGModeChange())
	if err != nil {
		return agent.Desired{}, err
	}
	defer cp.Close()
	journal, err := os.MkdirTemp("", "gpu-agent-validate")
	if err != nil {
		return agent.Desired{}, err
	}
	defer os.RemoveAll(journal)
	applier := mig.NewApplier(cp.Lib, journal, nil)
	// A pass may end at a mode change; the agent plans again after each.
	for range 3 {
		applied := false
		for _, gm := range d.MIG {
			if gm.State.Phase != mig.PhasePlanned {
				continue
			}
			st, err := applier.Apply(ctx, gm.Plan, nil)
			if err != nil {
				return agent.Desired{}, fmt.Errorf("gpu %d (%s): applying %s to a copy of %s: %w", gm.GPU, gm.UUID, gm.Want, be.Name, err)
			}
			if st.Phase != mig.PhaseApplied {
				return agent.Desired{}, fmt.Errorf("gpu %d (%s): applying %s to a copy of %s: %s: %s", gm.GPU, gm.UUID, gm.Want, be.Name, st.Phase, st.Reason)
			}
			applied = true
		}
		snap, err := offlineSnapshot(cp, sel)
		if err != nil {
			return agent.Desired{}, err
		}
		d = agent.Plan(snap)
		if !applied {
			break
		}
	}
	if d.FitErr != nil {
		return agent.Desired{}, fmt.Errorf("once the layout is applied, the config does not fit %s: %w", be.Name, d.FitErr)
	}
	return d, nil
}

func cmdInventory(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("inventory", "inventory [--backend sim:<profile>[,state=F]|nvml | --addr URL] [-o table|json]", stderr)
	var nf nodeFlags
	nf.register(fs)
	out := fs.String("o", "table", "output: table or json")
	fs.StringVar(out, "output", "table", "output: table or json (the same as -o)")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if *out != "table" && *out != "json" {
		return usageError{fmt.Sprintf("-o %q: want table or json", *out)}
	}
	be, err := nf.open(ctx, fs)
	if err != nil {
		return err
	}
	defer be.Close()
	inv, err := gpu.New(be.Lib, be.InventoryOptions)
	if err != nil {
		return err
	}
	if *out == "json" {
		return gpu.WriteJSON(stdout, inv)
	}
	fmt.Fprintf(stdout, "Backend: %s\n\n", be.Name)
	return gpu.WriteTable(stdout, inv)
}

func cmdSim(args []string, stdout, _ io.Writer) error {
	for _, a := range args {
		if a == "-h" || a == "--help" {
			fmt.Fprintln(stdout, "Usage: gpu-agent sim list\n\nLists the simulated nodes, for --backend sim:<profile>.")
			return nil
		}
	}
	if len(args) != 1 || args[0] != "list" {
		return usageError{"want: sim list"}
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROFILE\tDESCRIPTION")
	for _, p := range sim.Profiles() {
		fmt.Fprintf(tw, "sim:%s\t%s\n", p.Name, p.Description)
	}
	return tw.Flush()
}

const planSynopsis = "mig plan --config FILE [--backend sim:<profile>[,state=F]|nvml | --addr URL] [--node-name N] [--labels K=V,...]"

func cmdMIG(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if done, err := subcommand(args, "plan", planSynopsis, stdout); done {
		return err
	}
	fs := newFlagSet("mig plan", planSynopsis, stderr)
	file := fs.String("config", envDefault("GPU_AGENT_CONFIG", ""), "config file, ConfigMap manifest or directory [GPU_AGENT_CONFIG]")
	var nf nodeFlags
	nf.register(fs)
	var s selection
	s.register(fs)
	if err := parseNoArgs(fs, args[1:]); err != nil {
		return err
	}
	if *file == "" {
		return usageError{"want --config FILE"}
	}
	_, sel, _, err := s.load(*file, stderr)
	if err != nil {
		return err
	}
	if sel.MIGLayout == nil {
		fmt.Fprintf(stdout, "config %q has no MIG layout: the GPUs are left as they are\n", sel.Name)
		return nil
	}
	be, err := nf.open(ctx, fs)
	if err != nil {
		return err
	}
	defer be.Close()
	snap, err := offlineSnapshot(be, sel)
	if err != nil {
		return err
	}
	if err := printMIG(stdout, fmt.Sprintf("MIG layout of config %q on %s:\n", sel.Name, be.Name), snap, agent.Plan(snap), true); err != nil {
		return fmt.Errorf("%s: %w", *file, err)
	}
	return nil
}

// offlineSnapshot is what `config validate` and `mig plan` plan from: the
// backend's GPUs as they are, with nothing held (no kubelet is asked), so
// they show what the agent would do on an idle node.
func offlineSnapshot(be *backend, sel config.Selected) (agent.Snapshot, error) {
	obs := mig.NewObserver(be.Lib, be.InventoryOptions)
	inv, err := obs.Inventory()
	if err != nil {
		return agent.Snapshot{}, fmt.Errorf("inventory of %s: %w", be.Name, err)
	}
	snap := agent.Snapshot{
		Inventory: inv, Selected: sel, MPSSupervised: true, MIGApplies: true, DRA: true,
		Holdings: agent.Holdings{Fresh: true},
		Profiles: map[string]mig.Profiles{}, ProfileErrs: map[string]error{},
	}
	for _, g := range inv.GPUs {
		if _, done := snap.Profiles[g.Name]; done || !g.MIGCapable {
			continue
		}
		if p, err := obs.MIGProfiles(g); err != nil {
			snap.ProfileErrs[g.Name] = err
		} else {
			snap.Profiles[g.Name] = p
		}
	}
	snap.MIGOpen, snap.MIGOpening = agent.SettledMIGOpen(snap)
	return snap, nil
}

// printMIG prints, under header, per GPU what applying the layout would
// do; steps lists the steps too. An impossible layout is an error naming
// the GPU, and so is a layout that does nothing of what it is for on this
// node (checkSelectedLayout: a device-filter for another model).
func printMIG(stdout io.Writer, header string, snap agent.Snapshot, d agent.Desired, steps bool) error {
	planned := map[int]agent.GPUMIG{}
	for _, gm := range d.MIG {
		planned[gm.GPU] = gm
	}
	if errors.Is(d.FitErr, mig.ErrLayout) {
		return d.FitErr // refused whole: nothing would be applied
	}
	if d.MIGErr != nil && len(d.MIG) == 0 {
		return d.MIGErr
	}
	if err := checkSelectedLayout(snap, d); err != nil {
		return err
	}
	fmt.Fprint(stdout, header)
	for _, g := range snap.Inventory.GPUs {
		gm, ok := planned[g.Index]
		if !ok {
			fmt.Fprintf(stdout, "GPU %d (%s): no layout entry applies; left as it is\n", g.Index, g.Name)
			continue
		}
		fmt.Fprintf(stdout, "GPU %d (%s): want %s: %s", g.Index, g.Name, gm.Want, gm.State.Phase)
		if gm.State.Reason != "" {
			fmt.Fprintf(stdout, " (%s)", gm.State.Reason)
		}
		fmt.Fprintf(stdout, ", %d steps, %d instances destroyed\n", len(gm.Plan.Steps), gm.Plan.Destroys())
		for i, s := range gm.Plan.Steps {
			if steps {
				fmt.Fprintf(stdout, "  %d. %s\n", i+1, s.String())
			}
		}
	}
	writeUnmatched(stdout, snap)
	return d.MIGErr
}
