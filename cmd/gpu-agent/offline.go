package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

func cmdConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "validate" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent config validate FILE [--backend sim:P] [--node-name N]")
			return nil
		}
		return usageError{"want: config validate FILE [--backend sim:P] [--node-name N]"}
	}
	fs := newFlagSet("config validate", "config validate FILE [--backend sim:<profile>|nvml] [--node-name N]", stderr)
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "sim:dgx-a100"), "GPUs to plan against [GPU_AGENT_BACKEND]")
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "node whose config is selected [NODE_NAME]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	labelList := fs.String("labels", "", "the node's labels, k=v[,k=v...] (gpu-agent.io/config, nvidia.com/device-plugin.config, nvidia.com/mig.config)")
	defaultConfig := fs.String("default-config", envDefault("GPU_AGENT_DEFAULT_CONFIG", ""), "config for nodes nothing selects [GPU_AGENT_DEFAULT_CONFIG]")
	migStrategy := fs.String("mig-strategy", envDefault("MIG_STRATEGY", ""), "the agent's --mig-strategy: none, single or mixed [MIG_STRATEGY]")
	// Accept FILE before or after the flags.
	var file string
	rest := args[1:]
	if len(rest) > 0 && len(rest[0]) > 0 && rest[0][0] != '-' {
		file, rest = rest[0], rest[1:]
	}
	if err := parseFlags(fs, rest); err != nil {
		return err
	}
	if file == "" && fs.NArg() == 1 {
		file = fs.Arg(0)
	} else if fs.NArg() > 0 || file == "" {
		return usageError{"want exactly one FILE"}
	}
	labels := map[string]string{}
	for kv := range strings.SplitSeq(*labelList, ",") {
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return usageError{fmt.Sprintf("--labels %q: want key=value", kv)}
		}
		labels[k] = v
	}
	// A directory is a ConfigMap volume: every key is read.
	var u config.Update
	if st, err := os.Stat(file); err == nil && st.IsDir() {
		u.Files, err = config.ReadDir(file)
		if err != nil {
			return err
		}
	} else if u.Data, err = config.ReadFile(file); err != nil {
		return err
	}
	opts := config.ParseOptions{MIGStrategy: config.MIGStrategy(*migStrategy)}
	if err := opts.Check(); err != nil {
		return usageError{"--mig-strategy: " + err.Error()}
	}
	f, warnings, err := u.ParseWith(*defaultConfig, opts)
	for _, w := range warnings {
		fmt.Fprintf(stderr, "warning: %s: %s\n", file, w)
	}
	if err != nil {
		return fmt.Errorf("%s: invalid:\n%w", file, err)
	}
	sel, err := f.Select(*node, labels)
	if err != nil {
		return fmt.Errorf("%s: node %s: %w", file, *node, err)
	}
	be, err := openBackend(*backendSpec, *nvmlLib, slog.New(slog.NewTextHandler(stderr, nil)))
	if err != nil {
		return err
	}
	defer be.Close()
	snap, err := offlineSnapshot(be, sel)
	if err != nil {
		return err
	}
	d := agent.Plan(snap)
	if d.FitErr != nil {
		return fmt.Errorf("%s: does not fit %s: %w", file, be.Name, d.FitErr)
	}
	for _, w := range d.Warnings {
		fmt.Fprintf(stderr, "warning: %s: on %s: %s\n", file, be.Name, w)
	}
	cat := d.Catalog
	if sel.MIGLayout != nil {
		fmt.Fprintf(stdout, "MIG layout on %s:\n", be.Name)
		if err := printMIG(stdout, snap, d, false); err != nil {
			return fmt.Errorf("%s: MIG layout does not fit %s: %w", file, be.Name, err)
		}
	}
	fmt.Fprintf(stdout, "%s: valid (%s format); node %s uses config %q (by %s)\n", file, f.Format, *node, sel.Name, sel.Reason)
	fmt.Fprintf(stdout, "On %s it would offer:\n", be.Name)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
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

func cmdInventory(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("inventory", "inventory [--backend nvml|sim:<profile>] [-o table|json]", stderr)
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "nvml"), "GPU backend [GPU_AGENT_BACKEND]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	out := fs.String("o", "table", "output: table or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *out != "table" && *out != "json" {
		return usageError{fmt.Sprintf("-o %q: want table or json", *out)}
	}
	be, err := openBackend(*backendSpec, *nvmlLib, slog.New(slog.NewTextHandler(stderr, nil)))
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
	return gpu.WriteTable(stdout, inv)
}

func cmdSim(args []string, stdout, _ io.Writer) error {
	if len(args) != 1 || args[0] != "list" {
		if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent sim list")
			return nil
		}
		return usageError{"want: sim list"}
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROFILE\tDESCRIPTION")
	for _, p := range sim.Profiles() {
		fmt.Fprintf(tw, "sim:%s\t%s\n", p.Name, p.Description)
	}
	return tw.Flush()
}

func cmdMIG(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "plan" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent mig plan --config FILE [--backend sim:P|nvml] [--node-name N]")
			return nil
		}
		return usageError{"want: mig plan --config FILE [--backend sim:P] [--node-name N]"}
	}
	fs := newFlagSet("mig plan", "mig plan --config FILE [--backend sim:<profile>|nvml] [--node-name N]", stderr)
	file := fs.String("config", envDefault("GPU_AGENT_CONFIG", ""), "config file [GPU_AGENT_CONFIG]")
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "sim:dgx-h100"), "GPUs to plan for [GPU_AGENT_BACKEND]")
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "node whose config is selected [NODE_NAME]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	if *file == "" || fs.NArg() > 0 {
		return usageError{"want --config FILE and no other arguments"}
	}
	f, _, err := config.Load(*file)
	if err != nil {
		return fmt.Errorf("%s: invalid:\n%w", *file, err)
	}
	sel, err := f.Select(*node, nil)
	if err != nil {
		return fmt.Errorf("%s: node %s: %w", *file, *node, err)
	}
	if sel.MIGLayout == nil {
		fmt.Fprintf(stdout, "config %q has no MIG layout: the GPUs are left as they are\n", sel.Name)
		return nil
	}
	be, err := openBackend(*backendSpec, *nvmlLib, slog.New(slog.NewTextHandler(stderr, nil)))
	if err != nil {
		return err
	}
	defer be.Close()
	snap, err := offlineSnapshot(be, sel)
	if err != nil {
		return err
	}
	return printMIG(stdout, snap, agent.Plan(snap), true)
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
		Inventory: inv, Selected: sel, MPSSupervised: true, MIGApplies: true,
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
	return snap, nil
}

// printMIG prints, per GPU, what applying the layout would do; steps lists
// the steps too. An impossible layout is an error naming the GPU.
func printMIG(stdout io.Writer, snap agent.Snapshot, d agent.Desired, steps bool) error {
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
	return d.MIGErr
}
