package config

import "fmt"

// ParseOptions are the agent's settings that reading a config depends on.
// The zero value reads a file as Parse always has.
type ParseOptions struct {
	// MIGStrategy is the agent's --mig-strategy (NVIDIA's MIG_STRATEGY):
	// the MIG strategy of every config whose file does not give one. That
	// is a gpu-agent config without mig.strategy, an NVIDIA device-plugin
	// file without flags.migStrategy (NVIDIA's plugin then takes its
	// --mig-strategy too), every config made from a mig-parted entry, and
	// the implicit default (see Select). "" keeps each one's own default:
	// none for the first two (NVIDIA's default), mixed for the others,
	// which exist to serve the MIG devices a layout creates.
	MIGStrategy MIGStrategy
}

// Check reports an option value that is not one of its kind.
func (o ParseOptions) Check() error {
	switch o.MIGStrategy {
	case "", MIGStrategyNone, MIGStrategySingle, MIGStrategyMixed:
		return nil
	}
	return fmt.Errorf("MIG strategy %q: want %s, %s or %s", o.MIGStrategy, MIGStrategyNone, MIGStrategySingle, MIGStrategyMixed)
}

// layoutStrategy is the strategy for configs that exist to serve a MIG
// layout: mig-parted entries, the implicit default, a layout picked by the
// nvidia.com/mig.config label.
func (o ParseOptions) layoutStrategy() MIGStrategy {
	if o.MIGStrategy != "" {
		return o.MIGStrategy
	}
	return MIGStrategyMixed
}

// ParseWith is Parse with the agent's options.
func ParseWith(data []byte, o ParseOptions) (*File, []string, error) {
	return parse(data, newDecoder(), checkAll, o)
}

// fillMIGStrategy gives every config of f that has no MIG strategy the
// option's, before defaults and validation see it.
func fillMIGStrategy(f *File, o ParseOptions) {
	f.DefaultMIGStrategy = o.MIGStrategy
	if o.MIGStrategy == "" {
		return
	}
	for _, c := range f.Configs {
		if c != nil && c.MIG.Strategy == "" {
			c.MIG.Strategy = o.MIGStrategy
		}
	}
}

// BuiltIn is what the agent serves when it has no config, or none that
// applies on its first start: the implicit default (whole GPUs, every
// existing MIG device under o's strategy, else mixed; no sharing, no MIG
// changes), as the config named "default" of a file of its own.
func BuiltIn(o ParseOptions) *File {
	f := Default()
	f.DefaultMIGStrategy = o.MIGStrategy
	f.Configs[DefaultConfigName] = implicitDefaultWith(o)
	return f
}

// implicitDefaultWith is implicitDefault under o's MIG strategy.
func implicitDefaultWith(o ParseOptions) *Config {
	c := implicitDefault()
	c.MIG.Strategy = o.layoutStrategy()
	return c
}
