// Command fleet-bench measures how fast the real kube-scheduler binds pods with DRA claims when every node
// of a fleet publishes the ResourceSlices gpu-agent publishes (issue 28): one template Node's slices, as a
// real agent on a simulated node publishes them for each device model (config), are copied onto N fake
// Nodes of a control plane of its own (etcd, kube-apiserver, kube-scheduler; no kubelet, no controller
// manager), and P pods, each with a ResourceClaim of its own, are created and timed until bound. Each model
// is measured beside whole-gpus-only (the default model's 8 whole GPUs without counters) at the same N.
// `make fleet-bench` runs it; see test/e2e/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// exampleModels are the device models the project ships configs for: the example each is read from,
// relative to the repository ("" for the agent's built-in default).
var exampleModels = []model{
	{Name: "default"},
	{Name: "static-mig", Manifest: "deploy/examples/mig-h100-balanced.yaml"},
	{Name: "static-mig-lean", Manifest: "deploy/examples/mig-h100-balanced-lean.yaml"},
	{Name: "time-sliced", Manifest: "deploy/examples/time-slicing-x4.yaml"},
	{Name: "mig-on-demand", Manifest: "deploy/examples/dra-mig-on-demand.yaml"},
	{Name: "mig-every-placement", Manifest: "deploy/examples/dra-mig-on-demand-every-placement.yaml"},
}

type options struct {
	bins        binaries
	agent, repo string
	profile     string
	nodes       []int
	pods        int
	rounds      int
	models      []string
	modelFiles  map[string]string
	claims      []string
	migProfile  string
	limit       time.Duration
	settle      time.Duration
	out, work   string
	keep        bool
	// cpuprofile, when set, is a directory that gets a CPU profile of the scheduler for each scenario.
	cpuprofile string
	// mix, when above 0, also measures each model on that share of the nodes, the default model on the rest.
	mix float64
}

func main() {
	log.SetFlags(log.Ltime)
	o, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleet-bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		log.Printf("fleet-bench: %v", err)
		os.Exit(1)
	}
}

// repoDir is the repository this source file is in (cmd/fleet-bench is four levels down), for `go run`.
func repoDir() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "."
	}
	return filepath.Join(filepath.Dir(file), "..", "..", "..", "..")
}

func parseFlags(args []string) (options, error) {
	var o options
	fl := flag.NewFlagSet("fleet-bench", flag.ContinueOnError)
	fl.StringVar(&o.bins.Etcd, "etcd", os.Getenv("E2E_ETCD"), "etcd binary [E2E_ETCD]")
	fl.StringVar(&o.bins.APIServer, "kube-apiserver", os.Getenv("E2E_KUBE_APISERVER"), "kube-apiserver binary [E2E_KUBE_APISERVER]")
	fl.StringVar(&o.bins.Scheduler, "kube-scheduler", os.Getenv("E2E_KUBE_SCHEDULER"), "kube-scheduler binary [E2E_KUBE_SCHEDULER]")
	fl.StringVar(&o.agent, "agent", os.Getenv("E2E_GPU_AGENT"), "gpu-agent binary [E2E_GPU_AGENT]")
	fl.StringVar(&o.repo, "repo", repoDir(), "the repository (deploy/examples, deploy/manifests/dra)")
	fl.StringVar(&o.profile, "profile", "dgx-h100", "simulated node the agent runs on (sim:<profile>)")
	nodes := fl.String("nodes", "100,500", "fleet sizes N, comma- or space-separated")
	fl.IntVar(&o.pods, "pods", 100, "pods per scenario, each with a ResourceClaim of its own")
	fl.IntVar(&o.rounds, "rounds", 5, "times each scenario's pods are measured on one scheduler (the table gives the median rate)")
	models := fl.String("models", "default,static-mig,static-mig-lean,"+nvidiaShapeModel+",time-sliced,mig-on-demand,mig-every-placement",
		"device models to measure ("+baselineModel+" always is; "+nvidiaShapeModel+" is static-mig's devices as NVIDIA's DRA driver shapes them)")
	var files []string
	fl.Func("model-file", "NAME=FILE: the ConfigMap manifest (or an empty FILE: no config) of a model, instead of its example or as a new one; repeatable",
		func(s string) error { files = append(files, s); return nil })
	claims := fl.String("claims", "1gpu,mig-1g,2gpu-nvlink", "claims to measure")
	fl.StringVar(&o.migProfile, "mig-profile", "1g.10gb", "the MIG profile the mig-1g claim asks for (1g.5gb on an A100 40GB, 1g.23gb on a B200)")
	fl.DurationVar(&o.limit, "limit", 120*time.Second, "time limit for the pods of one scenario to be bound")
	fl.DurationVar(&o.settle, "settle", 10*time.Second, "how long an agent's slices must stay unchanged to be taken")
	fl.StringVar(&o.out, "out", "", "also write the table to this file")
	fl.StringVar(&o.work, "work", "", "directory for the control planes and agents (default: a new temp dir, removed at the end)")
	fl.BoolVar(&o.keep, "keep", false, "keep the work directory (logs) at the end")
	fl.StringVar(&o.cpuprofile, "cpuprofile", "", "write CPU (over the binding, at most 30 s) and heap profiles of the scheduler for each scenario to this directory")
	fl.Float64Var(&o.mix, "mix", 0, "also measure each model on this share of the nodes (0 < mix < 1), the default model on the rest")
	if err := fl.Parse(args); err != nil {
		return o, err
	}
	if fl.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fl.Args())
	}
	for _, s := range strings.FieldsFunc(*nodes, splitList) {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			return o, fmt.Errorf("-nodes: %q is not a positive number", s)
		}
		o.nodes = append(o.nodes, n)
	}
	o.models = strings.FieldsFunc(*models, splitList)
	o.claims = strings.FieldsFunc(*claims, splitList)
	o.modelFiles = map[string]string{}
	for _, f := range files {
		name, file, ok := strings.Cut(f, "=")
		if !ok || name == "" {
			return o, fmt.Errorf("-model-file %q: want NAME=FILE", f)
		}
		o.modelFiles[name] = file
	}
	for _, c := range o.claims {
		if !slices.ContainsFunc(claimSpecs(o.migProfile), func(s claimSpec) bool { return s.Name == c }) {
			return o, fmt.Errorf("-claims: unknown claim %q", c)
		}
	}
	for _, m := range o.models {
		_, file := o.modelFiles[m]
		_, derived := derivedModels[m]
		if m == baselineModel || (!file && !derived && !slices.ContainsFunc(exampleModels, func(e model) bool { return e.Name == m })) {
			return o, fmt.Errorf("-models: unknown model %q (give its config with -model-file %s=FILE)", m, m)
		}
	}
	switch {
	case o.mix < 0 || o.mix >= 1:
		return o, fmt.Errorf("-mix: %v is not a share of the nodes (0 < mix < 1; 0: off)", o.mix)
	case len(o.nodes) == 0:
		return o, errors.New("-nodes: none given")
	case o.pods < 1:
		return o, errors.New("-pods: want at least 1")
	case o.rounds < 1:
		return o, errors.New("-rounds: want at least 1")
	case o.limit <= 0:
		return o, errors.New("-limit: want a positive duration")
	}
	for flagName, p := range map[string]string{"-etcd": o.bins.Etcd, "-kube-apiserver": o.bins.APIServer,
		"-kube-scheduler": o.bins.Scheduler, "-agent": o.agent} {
		if p == "" {
			return o, fmt.Errorf("%s: no binary given (make fleet-bench builds and passes them)", flagName)
		}
		if st, err := os.Stat(p); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			return o, fmt.Errorf("%s %s: not an executable file (%v)", flagName, p, err)
		}
	}
	if o.cpuprofile != "" {
		if err := os.MkdirAll(o.cpuprofile, 0o755); err != nil {
			return o, fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	return o, nil
}

func splitList(r rune) bool { return r == ',' || r == ' ' }

// resolveModels is every model to get a template of, in the order asked, the default first (the baseline
// is derived from it); a model whose config file does not exist is left out, with the reason in skipped.
func resolveModels(o options) (ms []model, skipped []string) {
	names := []string{"default"}
	for _, name := range o.models {
		if d, ok := derivedModels[name]; ok {
			name = d.From // its agent runs; the model is derived from its slices
		}
		names = append(names, name)
	}
	seen := map[string]bool{}
	for _, name := range names {
		if seen[name] {
			continue
		}
		seen[name] = true
		m := model{Name: name}
		if file, ok := o.modelFiles[name]; ok {
			m.Manifest = file
		} else {
			i := slices.IndexFunc(exampleModels, func(e model) bool { return e.Name == name })
			if exampleModels[i].Manifest != "" {
				m.Manifest = filepath.Join(o.repo, exampleModels[i].Manifest)
			}
		}
		if m.Manifest != "" {
			if _, err := os.Stat(m.Manifest); errors.Is(err, fs.ErrNotExist) {
				skipped = append(skipped, fmt.Sprintf("- model %s: not measured: its config %s does not exist in this checkout (give one with -model-file %s=FILE).", name, m.Manifest, name))
				continue
			}
		}
		ms = append(ms, m)
	}
	return ms, skipped
}

func run(ctx context.Context, o options) (err error) {
	work := o.work
	if work == "" {
		if work, err = os.MkdirTemp("", "fleet-bench-"); err != nil {
			return err
		}
	} else if err := os.MkdirAll(work, 0o755); err != nil {
		return err
	}
	defer func() {
		if o.keep || err != nil {
			log.Printf("logs kept in %s", work)
			return
		}
		if rerr := os.RemoveAll(work); rerr != nil {
			log.Printf("remove %s: %v", work, rerr)
		}
	}()
	start := time.Now()
	models, skippedModels := resolveModels(o)
	for _, s := range skippedModels {
		log.Print(strings.TrimPrefix(s, "- "))
	}
	templates, version, err := getTemplates(ctx, o, models, filepath.Join(work, "templates"))
	if err != nil {
		return err
	}
	base, err := wholeGPUsOnly(templates["default"])
	if err != nil {
		return err
	}
	order := []template{base}
	measured := map[string]bool{}
	for _, name := range o.models {
		if measured[name] {
			continue
		}
		measured[name] = true
		if d, ok := derivedModels[name]; ok {
			from, ok := templates[d.From]
			if !ok {
				continue // its source model was left out (skippedModels says why)
			}
			t, err := d.Derive(from)
			if err != nil {
				return err
			}
			order = append(order, t)
		} else if t, ok := templates[name]; ok {
			order = append(order, t)
		}
	}
	for _, t := range order {
		st := t.stats()
		log.Printf("model %s: %d slices, %d devices, %s counter sets per node", t.Model, st.Slices, st.Devices, counters(st))
	}
	var claims []claimSpec
	for _, c := range claimSpecs(o.migProfile) {
		if slices.Contains(o.claims, c.Name) {
			claims = append(claims, c)
		}
	}

	var results []result
	// fleet is a run of n nodes of t, in the work directory's fleet-<n>-<name>.
	fleet := func(n int, name string, t template) *fleetRun {
		return &fleetRun{bins: o.bins, dir: filepath.Join(work, fmt.Sprintf("fleet-%d-%s", n, name)), repo: o.repo,
			tmpl: t, nodes: n, pods: o.pods, rounds: o.rounds, limit: o.limit, cpuprofile: o.cpuprofile, logf: log.Printf}
	}
	var runs []*fleetRun
	for _, n := range o.nodes {
		for _, t := range order {
			runs = append(runs, fleet(n, t.Model, t))
			if o.mix == 0 || t.Model == baselineModel || t.Model == "default" {
				continue
			}
			f := fleet(n, t.Model+"-mixed", t)
			f.others, f.mixed = templates["default"], max(1, int(o.mix*float64(n)+0.5))
			runs = append(runs, f)
		}
		// The baseline again after the models: every ratio at this N divides by it, so it is taken as the
		// mean of a reading before and after them (table), halving what one noisy reading moves them by.
		if len(order) > 1 {
			again := base
			again.Model = baselineAgain
			runs = append(runs, fleet(n, again.Model, again))
		}
	}
	for _, f := range runs {
		rs, err := f.run(ctx, claims)
		if err != nil && len(rs) < len(claims) {
			log.Printf("%s, %d nodes: %v", f.model(), f.nodes, err)
			for _, c := range claims[len(rs):] {
				rs = append(rs, result{Model: f.model(), Nodes: f.nodes, Claim: c.Name, Asked: o.pods, Err: err.Error()})
			}
		}
		results = append(results, rs...)
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	header := []string{
		fmt.Sprintf("Fleet benchmark: sim:%s, Kubernetes %s, %d pods per scenario, %d rounds (limit %s each), mig-1g claims %s, %d CPUs, %s in all.",
			o.profile, version, o.pods, o.rounds, o.limit, o.migProfile, runtime.NumCPU(), duration(time.Since(start))),
	}
	out := table(results, header, skippedModels) + "\n" + legend + "\n"
	fmt.Print(out)
	if o.out != "" {
		if err := os.WriteFile(o.out, []byte(out), 0o644); err != nil {
			return fmt.Errorf("-out: %w", err)
		}
	}
	return nil
}

// getTemplates runs the agent once per model against a control plane of its own and returns each model's
// slices, and the API server's version.
func getTemplates(ctx context.Context, o options, models []model, dir string) (map[string]template, string, error) {
	sctx, cancel := context.WithTimeout(ctx, 4*time.Minute)
	defer cancel()
	cp, err := harness.StartControlPlane(sctx, harness.ControlPlaneConfig{
		APIServer: o.bins.APIServer, Etcd: o.bins.Etcd, Dir: dir, LogDir: filepath.Join(dir, "logs"),
	})
	if err != nil {
		return nil, "", fmt.Errorf("control plane for the templates: %w", err)
	}
	defer func() {
		if err := cp.Stop(10 * time.Second); err != nil {
			log.Print(err)
		}
	}()
	v, err := cp.Client.Discovery().ServerVersion()
	if err != nil {
		return nil, "", fmt.Errorf("API server version: %w", err)
	}
	out := map[string]template{}
	for _, m := range models {
		t0 := time.Now()
		t, err := publishedSlices(ctx, cp.Client, m, "fleet-template-"+m.Name, agentRun{
			Agent: o.agent, Backend: "sim:" + o.profile, Dir: filepath.Join(dir, "agents"),
			Kubeconfig: cp.AdminKubeconfig(), Settle: o.settle, Timeout: 3 * time.Minute, Logf: log.Printf,
		})
		if err != nil {
			return nil, "", err
		}
		log.Printf("model %s: the agent's slices taken after %s", m.Name, duration(time.Since(t0)))
		out[m.Name] = t
	}
	return out, v.GitVersion, nil
}
