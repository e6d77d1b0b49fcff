package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/kube"
	"github.com/gpu-agent/gpu-agent/telemetry"
)

func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("status", "status [--addr URL] [-o table|json]", stderr)
	addr := fs.String("addr", envDefault("GPU_AGENT_ADDR", "http://127.0.0.1:9400"), "the agent's HTTP address [GPU_AGENT_ADDR]")
	out := fs.String("o", "table", "output: table or json")
	fs.StringVar(out, "output", "table", "output: table or json (the same as -o)")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if *out != "table" && *out != "json" {
		return usageError{fmt.Sprintf("-o %q: want table or json", *out)}
	}
	base := *addr
	if !strings.Contains(base, "://") {
		base = "http://" + base
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/status", nil)
	if err != nil {
		return usageError{fmt.Sprintf("--addr %q: %v", *addr, err)}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the agent at %s: %w", base, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("read %s/status: %w", base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s/status: %s: %s", base, resp.Status, strings.TrimSpace(string(body)))
	}
	if *out == "json" {
		_, err := stdout.Write(body)
		return err
	}
	var st agent.Status
	if err := json.Unmarshal(body, &st); err != nil {
		return fmt.Errorf("%s/status: not a gpu-agent status: %w", base, err)
	}
	if err := writeStatus(stdout, &st); err != nil {
		return err
	}
	// The holders come from /holders, as `gpu-agent top` reads them; an
	// agent that cannot say leaves the rest of the status standing.
	snap, herr := fetchHolders(ctx, strings.TrimRight(base, "/"))
	return writeStatusHolders(stdout, snap, herr)
}

// writeStatusHolders is status's holders section: who holds each GPU and
// device, how much of it they use and for how long they have not, in
// fewer columns than `gpu-agent top`; where any holder is an MPS client,
// each one's SM % as a part of its active-thread limit.
func writeStatusHolders(w io.Writer, snap *telemetry.HolderSnapshot, err error) error {
	if err != nil {
		_, werr := fmt.Fprintf(w, "\nHolders: not known: %v\n", err)
		return werr
	}
	idle := 0
	for _, u := range snap.Holders {
		if u.UtilKnown && u.IdleSeconds >= 60 {
			idle++
		}
	}
	switch {
	case snap.Time.IsZero():
		_, err := fmt.Fprintln(w, "\nHolders: not sampled yet")
		return err
	case len(snap.Holders) == 0:
		_, err := fmt.Fprintf(w, "\nHolders: none (sampled %s)\n", snap.Time.UTC().Format(time.RFC3339))
		return err
	}
	fmt.Fprintf(w, "\nHolders: %d, %d idle for a minute or more (sampled %s; gpu-agent top for more)\n", len(snap.Holders), idle,
		snap.Time.UTC().Format(time.RFC3339))
	mps := slices.ContainsFunc(snap.Holders, func(u telemetry.HolderUse) bool { return u.MPSThreadLimit > 0 })
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "HOLDER\tGPU\tDEVICE\tSHARE\tSM%\tMEMORY\tIDLE FOR"
	if mps {
		header += "\tMPS USED OF LIMIT"
	}
	fmt.Fprintln(tw, header)
	for _, u := range snap.Holders {
		who := u.Namespace + "/" + u.Pod + "/" + u.Container
		if u.Claim != nil {
			who += " (claim " + u.Claim.Name + ")"
		}
		mem := "-"
		if u.Attributed {
			mem = bytesIEC(u.FBBytes)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s", who, u.GPU, heldDevice(u), holderShare(u), pct(u.SM, u.UtilKnown), mem, idleFor(u))
		if mps {
			cell := "-"
			if limit, used := mpsUse(u); limit != "-" {
				cell = used + " of " + limit
			}
			fmt.Fprintf(tw, "\t%s", cell)
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// writeStatus renders a status as readable tables: everything /status says
// that an operator acts on (the health event log, history, stays JSON only).
func writeStatus(w io.Writer, st *agent.Status) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "Node:\t%s\n", st.Node)
	fmt.Fprintf(tw, "Backend:\t%s\n", st.Backend)
	// An agent from before build info serves none; say nothing rather than guess.
	if b := st.Build; b != nil {
		fmt.Fprintf(tw, "Agent:\tgpu-agent %s (commit %s, %s)\n", b.Version, b.Commit, b.GoVersion)
	}
	writeConfig(tw, st)
	writeCluster(tw, &st.Cluster)
	if !st.LastPass.IsZero() {
		fmt.Fprintf(tw, "Last reconcile:\t%s\n", st.LastPass.Format(time.RFC3339))
	}
	// The loop turns without publishing when nothing changed; a turn long
	// after the last publish is worth a line, one in the same second not.
	if !st.LastLoop.IsZero() && st.LastLoop.Sub(st.LastPass) >= time.Second {
		fmt.Fprintf(tw, "Last loop turn:\t%s\n", st.LastLoop.Format(time.RFC3339))
	}
	if s := st.State; s != nil {
		switch {
		case s.Error != "":
			fmt.Fprintf(tw, "State:\tNOT SAVED in %s since %s: %s\n", s.Dir, s.ErrorSince.Format(time.RFC3339), s.Error)
		case !s.CheckpointWritten.IsZero():
			fmt.Fprintf(tw, "State:\t%s, checkpoint written %s\n", s.Dir, s.CheckpointWritten.Format(time.RFC3339))
		default:
			fmt.Fprintf(tw, "State:\t%s\n", s.Dir)
		}
	}
	if c := st.CDI; c != nil {
		switch {
		case c.Error != "":
			fmt.Fprintf(tw, "CDI spec:\tNOT WRITTEN: %s\n", c.Error)
		case c.Spec == "":
			fmt.Fprintf(tw, "CDI spec:\tnone needed yet\n")
		default:
			fmt.Fprintf(tw, "CDI spec:\t%s, %d devices\n", c.Spec, c.Devices)
		}
	}
	writeHealthEvents(tw, st)
	fmt.Fprintln(tw)

	fmt.Fprintln(tw, "GPU\tNAME\tUUID\tMEMORY\tNUMA\tMIG")
	for _, g := range st.GPUs {
		mig := "-"
		if g.MIGCapable {
			mig = onOff(g.MIG.Current)
			if g.MIG.Pending != g.MIG.Current {
				mig += " (pending " + onOff(g.MIG.Pending) + ")"
			}
			if n := len(g.Instances); n > 0 {
				mig += fmt.Sprintf(", %d instances", n)
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.0f GiB\t%s\t%s\n", g.Index, g.Name, g.UUID,
			float64(g.MemoryBytes)/(1<<30), numa(g.NUMANode), mig)
	}
	for _, e := range st.Errors {
		fmt.Fprintf(tw, "!\t%s\n", e)
	}
	for _, u := range st.Unread {
		forget := "kept until NVML reads it again"
		if !u.ForgetAt.IsZero() {
			forget = "forgotten at " + u.ForgetAt.Format(time.RFC3339) + " unless NVML lists it again"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\tunreadable since %s: %s; %s\n", u.Index, u.Name, u.UUID, u.Since.Format(time.RFC3339), u.Reason, forget)
	}
	if c := st.Cordon; c != nil {
		for _, g := range c.GPUs {
			fmt.Fprintf(tw, "%d\t\t%s\tCORDONED (%s lists %s): offered to no new work; holders keep it\n", g.Index, g.UUID, kube.CordonAnnotation, g.As)
		}
		if len(c.Unknown) > 0 {
			fmt.Fprintf(tw, "!\t%s names no GPU of this node, ignored: %s\n", kube.CordonAnnotation, strings.Join(c.Unknown, ", "))
		}
	}
	fmt.Fprintln(tw)

	if len(st.Sharing) > 0 {
		fmt.Fprintln(tw, "SHARED DEVICE\tGPU\tRESOURCE\tMODE\tREPLICAS\tLIMITS\tHELD")
		for _, sh := range st.Sharing {
			limits := "-"
			if sh.Mode == "mps" {
				limits = fmt.Sprintf("threads %s%%, memory %s", sh.ActiveThreadPercentage, sh.PinnedMemoryLimit)
			}
			held := "-"
			if len(sh.Holders) > 0 {
				held = strings.Join(sh.Holders, "; ")
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%s\t%s\n", sh.Device, sh.GPU, sh.Resource, sh.Mode, sh.Replicas, limits, held)
		}
		fmt.Fprintln(tw)
	}

	if len(st.MIG) > 0 {
		fmt.Fprintln(tw, "GPU\tMIG WANT\tSTATE\tREASON")
		for _, m := range st.MIG {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", m.GPU, m.Want, m.Phase, m.Reason)
		}
		fmt.Fprintln(tw)
	}

	writeDRA(tw, st.DRA)
	if len(st.HealthCauses) > 0 {
		fmt.Fprintln(tw, "GPU\tHEALTH CAUSE\tSINCE\tCOUNT")
		for _, c := range st.HealthCauses {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\n", c.Index, c.Reason, c.Since.Format(time.RFC3339), c.Count)
		}
		fmt.Fprintln(tw)
	}

	reg := map[string]agent.Registration{}
	for _, r := range st.Registrations {
		reg[r.Resource] = r
	}
	fmt.Fprintln(tw, "RESOURCE\tDEVICES\tHEALTHY\tKUBELET")
	for _, r := range st.Resource {
		healthy := 0
		for _, d := range r.Devices {
			if d.Healthy {
				healthy++
			}
		}
		state := "not registered"
		if rr, ok := reg[r.Name]; ok {
			if rr.Registered {
				state = "registered " + rr.RegisteredAt.Format(time.RFC3339)
			} else if rr.LastError != "" {
				state = "not registered: " + rr.LastError
			}
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\n", r.Name, len(r.Devices), healthy, state)
	}
	fmt.Fprintln(tw)
	fmt.Fprintln(tw, "RESOURCE\tDEVICE\tGPU\tNUMA\tHELD BY\tHEALTH")
	for _, r := range st.Resource {
		for _, d := range r.Devices {
			h := "healthy"
			if !d.Healthy {
				h = "unhealthy"
				if d.Reason != "" {
					h += ": " + d.Reason
				}
			}
			held := d.HeldBy
			if held == "" {
				held = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", r.Name, d.ID, d.GPU, numa(d.NUMANode), held, h)
		}
	}
	return tw.Flush()
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

func numa(n int) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// writeConfig says which config is in force, from where, and, when it is not
// the one selected, what serves instead and why: the same as /status's
// config, never more hopeful.
func writeConfig(tw io.Writer, st *agent.Status) {
	c := st.Config
	selected := c.Name
	if c.SelectedBy != "" {
		selected += " (by " + c.SelectedBy + ")"
	}
	switch {
	case c.Serving != "" && c.Serving != c.Name:
		fmt.Fprintf(tw, "Config:\t%s from %s, generation %d; selected: %s, not applied\n", c.Serving, c.Source, c.Generation, orNone(selected))
	case c.Name == "":
		fmt.Fprintf(tw, "Config:\tnone in force yet (from %s)\n", c.Source)
	case c.Source == agent.BuiltInConfigName:
		// No file or ConfigMap was given: naming the selection would only
		// repeat "default" three ways.
		fmt.Fprintf(tw, "Config:\tthe built-in default (no --config or ConfigMap given)\n")
	default:
		fmt.Fprintf(tw, "Config:\t%s from %s, generation %d\n", selected, c.Source, c.Generation)
	}
	if c.Error != "" {
		var kept string
		switch {
		case c.Serving == agent.BuiltInConfigName:
			kept = "serving the built-in default"
		case c.Serving != "":
			kept = "serving " + c.Serving + ", the last config that fitted"
		case len(st.Resource) == 0:
			kept = "nothing served until a config applies"
		default:
			kept = "config " + c.Name + " stays in force"
		}
		if !c.ErrorSince.IsZero() {
			kept = "since " + c.ErrorSince.Format(time.RFC3339) + "; " + kept
		}
		fmt.Fprintf(tw, "Config error:\t%s (%s)\n", c.Error, kept)
	}
	for _, warn := range c.Warnings {
		fmt.Fprintf(tw, "Config warning:\t%s\n", warn)
	}
}

// writeCluster says whether the Kubernetes API answers, where the Node
// labels the agent owns stand, and whether the ConfigMap read through the
// API is in force.
func writeCluster(tw io.Writer, c *agent.ClusterStatus) {
	switch c.API {
	case kube.APIStandalone, "":
		fmt.Fprintf(tw, "Cluster:\tstandalone, no Kubernetes API: no node labels, Events or ConfigMap\n")
		return
	case kube.APIConnecting:
		fmt.Fprintf(tw, "Cluster:\tconnecting: the API server has not answered yet\n")
	case kube.APIUnreachable:
		fmt.Fprintf(tw, "Cluster:\tAPI server UNREACHABLE (serving on; labels, Events and the ConfigMap wait)\n")
	default:
		fmt.Fprintf(tw, "Cluster:\tAPI server %s\n", c.API)
	}
	for _, e := range c.Errors {
		fmt.Fprintf(tw, "API error:\t%s\n", e)
	}
	if l := c.Labels; l != nil {
		written := "never written"
		if !l.Written.IsZero() {
			written = "written " + l.Written.Format(time.RFC3339)
		}
		switch {
		case l.Error != "":
			fmt.Fprintf(tw, "Node labels:\t%d owned, %s; NOT UP TO DATE: %s\n", l.Owned, written, l.Error)
		case l.Pending:
			fmt.Fprintf(tw, "Node labels:\t%d owned, %s; a change is being written\n", l.Owned, written)
		default:
			fmt.Fprintf(tw, "Node labels:\t%d owned, %s\n", l.Owned, written)
		}
	}
	if cm := c.ConfigMap; cm != nil {
		if cm.InForce {
			fmt.Fprintf(tw, "ConfigMap:\t%s, in force\n", cm.Name)
		} else {
			fmt.Fprintf(tw, "ConfigMap:\t%s, NOT in force: %s\n", cm.Name, cm.Reason)
		}
	}
}

// writeHealthEvents names the GPUs NVML delivers no health events for: only
// the periodic probes watch them.
func writeHealthEvents(tw io.Writer, st *agent.Status) {
	if st.HealthEvents == nil {
		return
	}
	events := map[string]bool{}
	for _, u := range st.HealthEvents {
		events[u] = true
	}
	var missing []string
	for _, g := range st.GPUs {
		if !events[g.UUID] {
			missing = append(missing, fmt.Sprintf("%d (%s)", g.Index, g.UUID))
		}
	}
	if len(missing) == 0 {
		fmt.Fprintf(tw, "Health events:\tfrom NVML for every GPU\n")
		return
	}
	fmt.Fprintf(tw, "Health events:\tNONE from NVML for GPU %s: probed only\n", strings.Join(missing, ", "))
}

// writeDRA is the DRA side: the pool, where ResourceSlice publishing
// stands, the claims prepared and what released claims left to undo.
func writeDRA(tw io.Writer, d *agent.DRAStatus) {
	if d == nil {
		return
	}
	pool := fmt.Sprintf("%d devices in the pool", len(d.Devices))
	if len(d.Unhealthy) > 0 {
		pool += fmt.Sprintf(", %d tainted unhealthy: %s", len(d.Unhealthy), strings.Join(d.Unhealthy, ", "))
	}
	if len(d.Cordoned) > 0 {
		pool += fmt.Sprintf(", %d tainted cordoned: %s", len(d.Cordoned), strings.Join(d.Cordoned, ", "))
	}
	fmt.Fprintf(tw, "DRA:\t%s\n", pool)
	switch s := d.Slices; {
	case s == nil:
	case s.Generation > 0:
		fmt.Fprintf(tw, "DRA slices:\tgeneration %d handed to the API server %s\n", s.Generation, s.At.Format(time.RFC3339))
	case !s.WaitingForAPI.IsZero():
		fmt.Fprintf(tw, "DRA slices:\tNOT PUBLISHED: waiting for the API server since %s\n", s.WaitingForAPI.Format(time.RFC3339))
	default:
		fmt.Fprintf(tw, "DRA slices:\tnot published yet\n")
	}
	if len(d.Claims) == 0 {
		fmt.Fprintf(tw, "DRA claims:\tnone prepared\n")
	}
	if len(d.Releasing) == 0 {
		fmt.Fprintf(tw, "DRA releasing:\tnothing left to undo\n")
	}
	fmt.Fprintln(tw)
	if len(d.Claims) > 0 {
		fmt.Fprintln(tw, "CLAIM (DRA)\tDEVICES")
		for _, c := range d.Claims {
			name, devices, _ := strings.Cut(c, ": ")
			fmt.Fprintf(tw, "%s\t%s\n", name, devices)
		}
		fmt.Fprintln(tw)
	}
	if len(d.Releasing) > 0 {
		fmt.Fprintln(tw, "RELEASED CLAIM\tLEFT TO UNDO (retried after each read of the GPUs)")
		for _, r := range d.Releasing {
			name, left, _ := strings.Cut(r, ": ")
			fmt.Fprintf(tw, "%s\t%s\n", name, left)
		}
		fmt.Fprintln(tw)
	}
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}
